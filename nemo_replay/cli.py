"""``nemo-replay``: the main job and its helpers (also ``python -m nemo_replay``).

    nemo-replay train   [CONFIG] [key=value ...]   GRPO with replay (default: the embedded CPU recipe)
    nemo-replay compare [CONFIG] [key=value ...]   the same recipe with replay on and off, plotted together
    nemo-replay check   [CONFIG] [key=value ...]   validate and print the resolved recipe
    nemo-replay flags                              every flag with its default and meaning
    nemo-replay strategies                         registered replay strategies

CONFIG is a YAML file or ``pkg://<name>`` (a recipe shipped in the package); overrides use
OmegaConf dotlist syntax (``trainer.steps=50``, ``generation.top_k=null``). Under
``torchrun`` every rank runs the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]

_USAGE = __doc__.split("\n\n")[1]


def _split(args: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """(config, overrides): a first argument without '=' is the recipe."""
    args = list(args)
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _load(args: Sequence[str]):
    from nemo_replay.config.loading import load_config

    config, overrides = _split(args)
    return load_config(config, overrides)


def _train(args: Sequence[str]) -> int:
    cfg = _load(args)
    from nemo_replay.trainer.grpo import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    result = trainer.fit()
    if trainer.fabric.is_global_zero:
        s = result.summary
        print(
            f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} over {s['steps']} steps; "
            f"max |rollout - trainer| log-prob {s['mismatch_max']:.2e}; "
            f"first-step max |ratio - 1| {s['first_step_ratio_max_dev']:.2e}\n"
            f"metrics: {result.output_dir / 'metrics.jsonl'}"
            + (f"\nplot:    {result.output_dir / 'metrics.png'}" if cfg.trainer.plot else "")
        )
    return 0


def _compare(args: Sequence[str]) -> int:
    cfg = _load(args)
    from nemo_replay.trainer.compare import format_summary, run_compare

    result = run_compare(cfg)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(format_summary(result))
    return 0


def _check(args: Sequence[str]) -> int:
    from nemo_replay.config.loading import to_yaml

    print(to_yaml(_load(args)), end="")
    return 0


def _flags(args: Sequence[str]) -> int:
    from nemo_replay.config.schema import flag_docs

    for path, default, doc in flag_docs():
        print(f"{path} = {default!r}\n    {doc}")
    return 0


def _strategies(args: Sequence[str]) -> int:
    from nemo_replay.strategies.registry import available_strategies, get_strategy

    for name in available_strategies():
        try:
            description = get_strategy(name).description
        except Exception as exc:  # a plugin that fails to import is listed with the reason
            description = f"(cannot load: {exc})"
        print(f"{name:<12} {description}")
    return 0


COMMANDS = {"train": _train, "compare": _compare, "check": _check, "flags": _flags, "strategies": _strategies}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nemo-replay`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv[1:]):
        argv = ["--help"]
    parser = argparse.ArgumentParser(
        prog="nemo-replay", description="Support-conditioned log-prob replay: the main job.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_USAGE,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="[CONFIG] [key=value ...]")
    ns = parser.parse_args(argv[:1] or ["--help"])
    from nemo_replay.config.errors import ConfigError

    had_group = _group_initialized()
    try:
        return COMMANDS[ns.command](argv[1:])
    except ConfigError as exc:
        print(f"nemo-replay {ns.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # user-facing: names what was expected and the fix
        if os.environ.get("NEMO_REPLAY_DEBUG"):
            raise
        print(f"nemo-replay {ns.command}: {exc}\n(set NEMO_REPLAY_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    finally:
        # A process group this command created (torchrun, trainer.devices > 1) is torn down
        # here: left to interpreter exit, gloo's threads can abort the process.
        if not had_group and _group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()


def _group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


if __name__ == "__main__":
    sys.exit(main())
