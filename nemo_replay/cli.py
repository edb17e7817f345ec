"""``nemo-replay``: the main job and its helpers (also ``python -m nemo_replay``).

    nemo-replay train   [CONFIG] [key=value ...]   GRPO with replay (default: the embedded CPU recipe)
    nemo-replay compare [CONFIG] [key=value ...]   the same recipe with replay on and off, plotted together
    nemo-replay check   [CONFIG] [key=value ...]   validate and print the resolved recipe
    nemo-replay serve   [CONFIG] [key=value ...]   a loopback generate endpoint over the recipe's policy
    nemo-replay flags                              every flag with its default and meaning
    nemo-replay strategies                         registered replay strategies

CONFIG is a YAML file or ``pkg://<name>`` (a recipe shipped in the package); overrides use
OmegaConf dotlist syntax (``trainer.steps=50``, ``generation.top_k=null``). Under
``torchrun`` every rank runs the same command. ``nemo-replay COMMAND --help`` describes one
command.

Exit status: 0 done; 2 a usage or recipe error (one message listing every problem); 75 the
run stopped on a signal after writing a checkpoint (run the same command to continue); 1
a run that failed (a collective timed out, ...).
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import sys
from typing import Optional, Sequence

__all__ = ["main"]

_USAGE = __doc__.split("\n\n")[1]

_RECIPE_HELP = """\
CONFIG is a YAML recipe or pkg://<name> (default: the embedded CPU recipe); every other
argument is a key=value override (trainer.steps=50, generation.top_k=null). `nemo-replay
flags` lists every flag."""

_TRAIN_EPILOG = _RECIPE_HELP + """

Long runs. A checkpoint is written every trainer.checkpoint_every steps and after the last
step, under <output_dir>/checkpoints/. Running the same command again with the same
trainer.output_dir continues from the latest complete checkpoint (trainer.resume=auto;
never: refuse a folder that holds a run; must: fail without a checkpoint). SIGTERM,
SIGUSR1 or Ctrl-C finish the current step, write a checkpoint, the plot and summary.json,
then exit with status 75; a second signal exits at once.
"""

_COMMANDS = {
    "train": ("GRPO with support-conditioned replay", _TRAIN_EPILOG),
    "compare": ("the same recipe with replay on and off, from the same seed, plotted together", _RECIPE_HELP),
    "check": ("validate the recipe (every rule, paths included) and print it resolved", _RECIPE_HELP),
    "serve": ("a loopback generate endpoint (support capture) over the recipe's policy", _RECIPE_HELP),
    "flags": ("every flag with its default and meaning", None),
    "strategies": ("registered replay strategies", None),
}
_TAKES_RECIPE = ("train", "compare", "check", "serve")


def _split(args: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """(config, overrides): a first argument without '=' is the recipe."""
    args = list(args)
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _load(args: Sequence[str]):
    from nemo_replay.trainer.config.loading import load_config

    config, overrides = _split(args)
    return load_config(config, overrides)


def _launcher_argv() -> Optional[list[str]]:
    """The command line of the torchrun that started this worker (its parent), or None.

    A checkpoint resumes only with the process count that wrote it, so the resume command
    of a torchrun worker is its launcher's command line, read from ``/proc``. Where that
    cannot be read, one is rebuilt from torchrun's environment (``LOCAL_WORLD_SIZE``,
    ``WORLD_SIZE``).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    names = ("torchrun", "torch.distributed.run", "nemo_replay.trainer.torchrun")
    at = next((i for i, a in enumerate(argv) if a.endswith(names)), None)
    if at is not None and "-m" in argv[at + 1:]:
        if at > 0 and argv[at - 1] != "-m":
            return argv[at:]  # `python /usr/bin/torchrun ...` is `torchrun ...`
        return ["python", *argv[1:]] if at > 0 else argv
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    nodes = int(os.environ.get("WORLD_SIZE", local)) // max(1, int(local))
    return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={local}", "-m", "nemo_replay"]


def _resume_hint(command: str, args: Sequence[str], output_dir) -> str:
    """The command that continues a stopped run: this one (its launcher included), naming its folder."""
    launcher = _launcher_argv()
    if launcher is None:
        again = ["nemo-replay", command, *args]
    elif launcher[-1] == "nemo_replay":  # rebuilt from the environment
        again = [*launcher, command, *args]
    else:
        again = launcher  # the launcher's own line: its arguments, then `-m <module> <command> <args>`
    if not any(a.startswith("trainer.output_dir=") for a in args):
        again.append(f"trainer.output_dir={output_dir}")
    return shlex.join(again)


def _train(args: Sequence[str], ns: argparse.Namespace) -> int:
    cfg = _load(args)
    from nemo_replay.trainer.grpo import GRPOTrainer
    from nemo_replay.trainer.preemption import stopped_exit

    overrides = [f.strip() for item in (ns.resume_override or []) for f in item.split(",") if f.strip()]
    trainer = GRPOTrainer(cfg, resume_overrides=overrides)
    zero = trainer.fabric.is_global_zero
    if zero and trainer.resume_line():
        print(f"nemo-replay train: {trainer.resume_line()}", file=sys.stderr)
    result = trainer.fit()
    if not zero:
        return stopped_exit() if result.stopped_by else 0
    s = result.summary
    if result.stopped_by:
        done = result.history[-1]["step"] + 1 if result.history else 0
        print(
            f"nemo-replay train: stopped by {result.stopped_by} after {done} of {cfg.trainer.steps} steps; "
            f"checkpoint {result.last_checkpoint}\nresume with: {_resume_hint('train', args, result.output_dir)}",
            file=sys.stderr,
        )
        return stopped_exit()
    print(
        f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} over {s['steps']} steps; "
        f"max |rollout - trainer| log-prob {s['mismatch_max']:.2e}; "
        f"first-step max |ratio - 1| {s['first_step_ratio_max_dev']:.2e}\n"
        f"metrics: {result.output_dir / 'metrics.jsonl'}"
        + (f"\nplot:    {result.output_dir / 'metrics.png'}" if cfg.trainer.plot else "")
    )
    return 0


def _compare(args: Sequence[str], ns: argparse.Namespace) -> int:
    cfg = _load(args)
    import torch.distributed as dist

    from nemo_replay.trainer.compare import format_summary, run_compare
    from nemo_replay.trainer.preemption import stopped_exit

    result = run_compare(cfg)
    zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if result.stopped_by:
        if zero:
            print(
                f"nemo-replay compare: stopped by {result.stopped_by}; resume with: "
                f"{_resume_hint('compare', args, result.output_dir)}",
                file=sys.stderr,
            )
        return stopped_exit()
    if zero:
        print(format_summary(result))
    return 0


def _check(args: Sequence[str], ns: argparse.Namespace) -> int:
    from nemo_replay.trainer.config.loading import to_yaml

    print(to_yaml(_load(args)), end="")
    return 0


def _flags(args: Sequence[str], ns: argparse.Namespace) -> int:
    from nemo_replay.trainer.config.schema import flag_docs

    for path, default, doc in flag_docs():
        print(f"{path} = {default!r}\n    {doc}")
    return 0


def _strategies(args: Sequence[str], ns: argparse.Namespace) -> int:
    from nemo_replay.strategies.registry import available_strategies, get_strategy

    for name in available_strategies():
        try:
            description = get_strategy(name).description
        except Exception as exc:  # a plugin that fails to import is listed with the reason
            description = f"(cannot load: {exc})"
        print(f"{name:<12} {description}")
    return 0


def build_server(args: Sequence[str], ns: argparse.Namespace):
    """The (unstarted) generate server of ``nemo-replay serve``: the recipe's policy behind capture."""
    import torch

    from nemo_replay.rollout.transport.server import GenerateServer, read_token_file
    from nemo_replay.trainer.backends.hf import build_hf_model

    token = read_token_file(ns.token_file) if ns.token_file is not None else ns.token  # before the model: fail fast
    cfg = _load(args)
    torch.manual_seed(cfg.trainer.seed)
    model = build_hf_model(cfg).eval()

    @torch.no_grad()
    def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens[None]).logits[0, -1].float()

    return GenerateServer(
        logits_fn, vocab_size=cfg.model.vocab_size, eos_id=cfg.generation.stop_token_id, host=ns.host, port=ns.port,
        token=token, max_new_tokens_cap=ns.max_new_tokens_cap, max_body_bytes=ns.max_body_bytes,
        max_json_values=ns.max_json_values, body_timeout_s=ns.body_timeout_s, max_concurrent=ns.max_concurrent,
        max_context_tokens=cfg.model.max_position_embeddings, max_connections=ns.max_connections,
        idle_timeout_s=ns.idle_timeout_s,
    )


def _serve(args: Sequence[str], ns: argparse.Namespace) -> int:
    import asyncio

    from nemo_replay.rollout.transport.server import serve_until_cancelled

    server = build_server(args, ns)
    try:
        asyncio.run(serve_until_cancelled(server, announce=lambda line: print(line, flush=True)))
    except KeyboardInterrupt:
        pass
    return 0


def _train_options(cmd: argparse.ArgumentParser) -> None:
    from nemo_replay.trainer.rundir import OVERRIDABLE

    cmd.add_argument(
        "--resume-override", action="append", metavar="FLAG[,FLAG]",
        help=f"on resume, accept a changed value of FLAG ({', '.join(sorted(OVERRIDABLE))}), e.g. a smaller "
        f"trainer.lr after a diverged run; the change is recorded in the run's resume.log",
    )


def _serve_options(cmd: argparse.ArgumentParser) -> None:
    from nemo_replay.rollout.transport.server import MAX_JSON_VALUES, TOKEN_ENV

    cmd.add_argument("--host", default="127.0.0.1", help="a loopback address (the server binds loopback only)")
    cmd.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    token = cmd.add_mutually_exclusive_group()
    token.add_argument(
        "--token-file", default=None, metavar="PATH",
        help="read the bearer token clients must send from PATH (one trailing newline stripped; the file must "
        "not be readable by group or others: chmod 600)",
    )
    token.add_argument(
        "--token", default=None,
        help=f"bearer token clients must send (default: ${TOKEN_ENV}; unset: none). Other users of the host see "
        f"it in the process list (ps): prefer --token-file or ${TOKEN_ENV}",
    )
    cmd.add_argument("--max-new-tokens-cap", type=int, default=4096, help="largest max_new_tokens a request may ask")
    cmd.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    cmd.add_argument(
        "--max-json-values", type=int, default=MAX_JSON_VALUES,
        help="bodies with more JSON values outside array envelopes get 413, before parsing (input_ids as a JSON "
        "list: about this many tokens; the int32 envelope form fills --max-body-bytes)",
    )
    cmd.add_argument("--body-timeout-s", type=float, default=30.0, help="a body slower than this gets 408")
    cmd.add_argument("--max-concurrent", type=int, default=64, help="requests past this get 429")
    cmd.add_argument("--max-connections", type=int, default=256,
                     help="open connections past this get 503 and are closed (keep it under ulimit -n)")
    cmd.add_argument("--idle-timeout-s", type=float, default=15.0,
                     help="a connection idle, or still sending its headers, this long is closed")


COMMANDS = {
    "train": _train, "compare": _compare, "check": _check, "serve": _serve, "flags": _flags, "strategies": _strategies,
}


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The top-level parser and each command's own (for its usage and errors)."""
    parser = argparse.ArgumentParser(
        prog="nemo-replay", description="Support-conditioned log-prob replay: the main job.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_USAGE,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    commands = {}
    for name, (summary, epilog) in _COMMANDS.items():
        cmd = commands[name] = sub.add_parser(
            name, help=summary, description=summary, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name in _TAKES_RECIPE:
            cmd.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]", help="recipe and overrides")
        if name == "train":
            _train_options(cmd)
        if name == "serve":
            _serve_options(cmd)
    return parser, commands


def _run(command: str, ns: argparse.Namespace) -> int:
    """One command, with its errors turned into messages and exit statuses (see the module doc)."""
    from nemo_replay.trainer.config.errors import ConfigError
    from nemo_replay.trainer.guards import CollectiveError, NonFiniteError

    debug = bool(os.environ.get("NEMO_REPLAY_DEBUG"))
    hint = "" if debug else "\n(set NEMO_REPLAY_DEBUG=1 for the traceback)"
    try:
        return COMMANDS[command](list(getattr(ns, "args", [])), ns)
    except ConfigError as exc:
        print(f"nemo-replay {command}: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:  # a failed run (it diverged), not a usage error
        if debug:
            raise
        print(f"nemo-replay {command}: {exc}{hint}", file=sys.stderr)
        return 1
    except ValueError as exc:  # user-facing: names what was expected and the fix
        if debug:
            raise
        print(f"nemo-replay {command}: {exc}{hint}", file=sys.stderr)
        return 2
    except CollectiveError as exc:
        if debug:
            raise
        print(f"nemo-replay {command}: {exc}{hint}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk: one line naming the path (the checkpoint's own check, or the OS's)
        if debug or exc.errno != errno.ENOSPC:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"nemo-replay {command}: no space left: {exc.strerror}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the loop installed its handlers (model building, ...)
        print(f"nemo-replay {command}: interrupted before the first step; nothing to resume", file=sys.stderr)
        return 130


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nemo-replay`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parser()
    try:
        ns, extra = parser.parse_known_args(argv)
        if extra:  # reported by the command's own parser, with its usage
            (commands[ns.command] if ns.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a usage error (2, the message already printed)
        return int(exc.code or 0)
    if ns.command is None:
        parser.print_usage(sys.stderr)
        print("nemo-replay: error: a command is required (train, compare, check, serve, flags, strategies)", file=sys.stderr)
        return 2
    had_group = _group_initialized()
    try:
        return _run(ns.command, ns)
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
