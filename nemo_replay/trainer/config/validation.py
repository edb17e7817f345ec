"""Cross-flag rules of a recipe, checked before any model is built (docs/design.md §8).

:func:`collect_problems` returns every violated rule as one line naming the flag, the
value it holds and the fix; :func:`validate` raises them together as one
:class:`~nemo_replay.trainer.config.errors.ConfigError`. The rules:

- replay on without support capture;
- sampling that cannot be captured: temperature missing or <= 0, ``top_k <= 1`` for
  fixed-width rows, rows narrower than the sampler's top-k, a repetition penalty != 1;
- an unregistered strategy (the message lists the registered ones);
- the strategy's own rules, from its spec (``StrategySpec.check_config``: e.g. context
  parallel without packing for megatron, TP / CP / PP with fsdp); route replay with a
  strategy that cannot replay routes;
- parallel sizes that do not divide the world (the strategy's ``parallel_sizes``), prompts
  that do not split over the data-parallel ranks, heads that do not split over TP / SP;
- the rollout engine: ``generation.engine`` one the strategy's model backend offers (``hf``
  needs Hugging Face models: the fsdp strategy; megatron samples with ``trainer``), and
  ``generation.dtype`` only for the ``hf`` engine;
- plain range checks on the loop and model sizes;
- every number finite: a NaN or an infinity in any float flag is refused (``trainer.kl_coef=nan``
  would silently switch the KL term off), and reported once, not again by its range check;
- the long-run flags: the seed's range, ``trainer.resume``, checkpoint cadence and the
  collective timeout;
- paths (:mod:`nemo_replay.trainer.config.paths`): ``model.pretrained`` must be a local checkpoint
  folder, ``trainer.output_dir`` must not be (or be under) a file;
- ``trainer.loggers``: known names (the message lists them), each once, ``jsonl`` among them,
  and the package of each installed (the message names the extra to install).
"""

from __future__ import annotations

import math
import os
from typing import Optional

from nemo_replay.rollout.capture.sampler import TEMPERATURE_RANGE
from nemo_replay.scoring.plan import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE
from nemo_replay.trainer.config.errors import ConfigError
from nemo_replay.trainer.config.paths import output_dir_problem, pretrained_problem
from nemo_replay.trainer.config.schema import RecipeConfig, flag_docs

__all__ = ["collect_problems", "validate", "resolve_world_size", "model_parallel_size", "rollout_engines", "resolve_engine"]

_SOURCES = ("logits", "hidden")
_OLD_LOGPROBS = ("recompute", "rollout")
#: ``trainer.objective`` values (nemo_replay/objectives.py: TokenRatioObjective, SequenceRatioObjective,
#: TruncatedISObjective).
OBJECTIVES = ("token_ratio", "sequence_ratio", "tis")
_ACCELERATORS = ("cpu", "gpu", "auto")
_DTYPES = ("float32", "bfloat16", "float16")
_ENGINES = ("auto", "hf", "trainer", "vllm", "vllm-server")
_OWN_WEIGHTS = ("hf", "vllm", "vllm-server")  # engines holding their own copy of the weights, in generation.dtype
_RESUME = ("auto", "never", "must")
LR_MAX = 1e30
SEED_MAX = 2**32 - 1  # numpy's seed range, which Fabric's seed_everything enforces


def resolve_world_size(cfg: RecipeConfig, world_size: Optional[int] = None) -> int:
    """``world_size`` if given, else ``WORLD_SIZE`` (torchrun), else ``devices * num_nodes``."""
    if world_size is not None:
        return int(world_size)
    env = os.environ.get("WORLD_SIZE")
    if env:
        return int(env)
    return max(1, cfg.trainer.devices) * max(1, cfg.trainer.num_nodes)


def _spec(cfg: RecipeConfig):
    """The spec of ``replay.strategy``, or None when it cannot be loaded (:func:`_replay` reports why)."""
    from nemo_replay.strategies.registry import get_strategy

    try:
        return get_strategy(cfg.replay.strategy)
    except ValueError:
        return None


def model_parallel_size(cfg: RecipeConfig) -> int:
    """Ranks that hold one copy of the data, as the strategy's spec counts them (1 if unregistered)."""
    spec = _spec(cfg)
    return 1 if spec is None else spec.model_parallel_size(cfg)


def rollout_engines(cfg: RecipeConfig) -> tuple[str, ...]:
    """Rollout engines the strategy's model backend offers, preferred first.

    The backend class (``StrategySpec.trainer_backend``) lists them as ``rollout_engines``;
    one that lists none samples with its own forward (``("trainer",)``), as does a strategy
    without a backend or an unregistered one.
    """
    spec = _spec(cfg)
    if spec is None or spec.trainer_backend is None:
        return ("trainer",)
    return tuple(getattr(spec.load_trainer_backend(), "rollout_engines", ("trainer",)))


def resolve_engine(cfg: RecipeConfig) -> str:
    """``generation.engine`` with ``auto`` replaced by the backend's preferred engine."""
    engine = cfg.generation.engine
    return rollout_engines(cfg)[0] if engine == "auto" else engine


def _engine(cfg: RecipeConfig, world: int, out: list[str]) -> None:
    g = cfg.generation
    if g.engine not in _ENGINES:
        out.append(f"generation.engine={g.engine!r} must be one of {', '.join(_ENGINES)}")
        return
    offered = rollout_engines(cfg)
    if g.engine != "auto" and g.engine not in offered:
        out.append(
            f"generation.engine={g.engine} needs a Hugging Face model, but replay.strategy={cfg.replay.strategy} "
            f"builds its own (engines it offers: {', '.join(offered)}); set generation.engine={offered[0]} or auto"
        )
    if g.dtype is not None:
        if g.dtype not in _DTYPES:
            out.append(f"generation.dtype={g.dtype!r} must be one of {', '.join(_DTYPES)} or null (model.dtype)")
        elif resolve_engine(cfg) not in _OWN_WEIGHTS and g.dtype != cfg.model.dtype:
            out.append(
                f"generation.dtype={g.dtype} applies to the hf engine's own weights (and the vllm engine's); the "
                f"{resolve_engine(cfg)} engine samples with the trainer's {cfg.model.dtype} weights. Set "
                f"generation.dtype=null, or generation.engine=hf"
            )
    if resolve_engine(cfg) in ("vllm", "vllm-server"):
        _vllm(cfg, world, out)


def _vllm(cfg: RecipeConfig, world: int, out: list[str]) -> None:
    """What the ``vllm`` engine cannot run (docs/engines.md, "A live vLLM")."""
    g, engine = cfg.generation, resolve_engine(cfg)
    if g.top_k is None:
        out.append(f"generation.engine={engine} reads each support from vLLM's processed log-probs, which show a support "
                   "only when it is bounded: set generation.top_k (> 1)")
    if world != 1:
        out.append(f"generation.engine={engine} runs one vLLM beside one trainer process; this recipe has {world} "
                   f"processes (trainer.devices x trainer.num_nodes, or WORLD_SIZE): set trainer.devices=1 "
                   f"trainer.num_nodes=1, or generation.engine=hf for a multi-process run")
    if cfg.replay.strategy == "megatron" and cfg.model.num_experts > 0:
        out.append(f"generation.engine={engine} loads the megatron model's weights as a Hugging Face Llama "
                   f"(trainer/backends/megatron_export.py), which an MoE model (model.num_experts="
                   f"{cfg.model.num_experts}) has no form of; set generation.engine=trainer, or model.num_experts=0")
    if cfg.replay.route_replay:
        out.append("replay.route_replay=true needs the engine's MoE routes, which vLLM does not return here; set "
                   f"replay.route_replay=false with generation.engine={engine}")
    share = g.vllm.memory_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
        out.append(f"generation.vllm.memory_share={share!r} must be in (0, 1] (vLLM's gpu_memory_utilization), "
                   f"e.g. 0.05")
    url, timeout = g.vllm.url, g.vllm.start_timeout
    if url is not None and (engine != "vllm-server" or not str(url).startswith(("http://", "https://"))):
        out.append(f"generation.vllm.url={url!r}: a running vLLM server's http://host:port, with "
                   f"generation.engine=vllm-server (generation.engine={engine}); or null")
    if not timeout > 0:
        out.append(f"generation.vllm.start_timeout={timeout} must be > 0 (seconds; e.g. 300)")


def _sampling(cfg: RecipeConfig, out: list[str]) -> None:
    g, cap = cfg.generation, cfg.replay.sample_support
    why = " (support capture needs a sampled distribution)" if cap.enabled else ""
    if g.temperature is None:
        out.append(f"generation.temperature is missing{why}; set generation.temperature=1.0")
    elif not (math.isfinite(g.temperature) and g.temperature > 0):
        out.append(
            f"generation.temperature={g.temperature} must be > 0 (<= 0 means greedy decoding, which RL "
            f"cannot train on{why}); set generation.temperature=1.0"
        )
    elif not TEMPERATURE_RANGE[0] <= g.temperature <= TEMPERATURE_RANGE[1]:
        out.append(
            f"generation.temperature={g.temperature} must be in [{TEMPERATURE_RANGE[0]}, {TEMPERATURE_RANGE[1]}]: vLLM "
            f"samples at 0.01 whatever lower value it is sent, and logits / temperature leave float32's range near "
            f"0; set generation.temperature within it, e.g. 1.0"
        )
    if g.top_k is not None and g.top_k <= 1:
        out.append(
            f"generation.top_k={g.top_k} must be > 1 for fixed-width support rows (top_k=1 is greedy); "
            f"set generation.top_k to e.g. 8, or null for ragged top-p rows"
        )
    if not 0.0 < g.top_p <= 1.0:
        out.append(f"generation.top_p={g.top_p} must be in (0, 1]; 1.0 disables top-p")
    if not 0.0 <= g.min_p < 1.0:
        out.append(f"generation.min_p={g.min_p} must be in [0, 1); 0.0 disables min-p")
    if g.repetition_penalty != 1.0:
        out.append(
            f"generation.repetition_penalty={g.repetition_penalty}: a penalty rewrites logits from the "
            f"generation history, which no trainer pass reproduces, so the captured support and "
            f"log-probs cannot be replayed; set generation.repetition_penalty=1.0"
        )
    if g.max_new_tokens < 1:
        out.append(f"generation.max_new_tokens={g.max_new_tokens} must be >= 1")
    if g.stop_token_id is not None and not 0 <= g.stop_token_id < cfg.model.vocab_size:
        out.append(
            f"generation.stop_token_id={g.stop_token_id} is outside the vocabulary [0, {cfg.model.vocab_size}); "
            f"set a valid id or null"
        )
    if cap.enabled and cap.top_k is not None:
        if cap.top_k <= 1:
            out.append(
                f"replay.sample_support.top_k={cap.top_k} must be > 1 for fixed-width rows; set it to "
                f"generation.top_k or null"
            )
        elif g.top_k is None:
            out.append(
                f"replay.sample_support.top_k={cap.top_k} with generation.top_k=null would cut the top-p / "
                f"min-p support to {cap.top_k} columns; set replay.sample_support.top_k=null (ragged rows) "
                f"or bound the sampler with generation.top_k"
            )
        elif cap.top_k < g.top_k:
            out.append(
                f"replay.sample_support.top_k={cap.top_k} is narrower than generation.top_k={g.top_k}, so rows "
                f"could not hold the sampled support; set replay.sample_support.top_k >= {g.top_k} or null"
            )


def _replay(cfg: RecipeConfig, out: list[str]) -> None:
    from nemo_replay.strategies.registry import available_strategies, get_strategy

    r = cfg.replay
    if r.enabled and not r.sample_support.enabled:
        out.append(
            "replay.enabled=true needs recorded support, but replay.sample_support.enabled=false; set "
            "replay.sample_support.enabled=true, or replay.enabled=false for the full-vocabulary baseline"
        )
    names = available_strategies()
    if r.strategy not in names:
        out.append(
            f"replay.strategy={r.strategy!r} is not registered; registered strategies: {', '.join(names)}. "
            f"Pick one, or install a plugin under the 'nemo_replay.strategies' entry-point group"
        )
    else:
        try:
            get_strategy(r.strategy)
        except ValueError as exc:  # a plugin whose entry point does not load to a StrategySpec
            out.append(f"replay.strategy={r.strategy!r} cannot be loaded: {exc}")
    if r.scorer.source not in _SOURCES:
        out.append(f"replay.scorer.source={r.scorer.source!r} must be one of {', '.join(_SOURCES)}")
    if not 1 <= r.scorer.chunk_size <= MAX_CHUNK_SIZE:
        out.append(f"replay.scorer.chunk_size={r.scorer.chunk_size} must be in [1, {MAX_CHUNK_SIZE}] (pairs projected per "
                   f"chunk; the default is {DEFAULT_CHUNK_SIZE})")
    spec = _spec(cfg)
    if r.route_replay and spec is not None and not spec.supports_route_replay:
        out.append(
            f"replay.route_replay=true needs a strategy that replays MoE routes; replay.strategy={r.strategy!r} "
            f"does not. Set replay.route_replay=false, or replay.strategy=megatron with an MoE model"
        )


def _num_threads(num_threads: Optional[int], out: list[str]) -> None:
    """Threads past the machine's cores only contend; at 16384 libgomp aborts the process, and
    at a million their start starves every process of the machine of thread ids."""
    cores = os.cpu_count() or 1
    if num_threads is not None and not 1 <= num_threads <= cores:
        out.append(f"trainer.num_threads={num_threads} must be in [1, {cores}] (this machine's cores, os.cpu_count()) "
                   f"or null for torch's choice")


def _parallel(cfg: RecipeConfig, world: int, out: list[str]) -> None:
    p, m, spec = cfg.parallel, cfg.model, _spec(cfg)
    for name in ("tensor", "pipeline", "context", "expert", "sequence"):
        if getattr(p, name) < 1:
            out.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    for name in ("tensor", "sequence"):
        size = getattr(p, name)
        if size > 1 and m.num_attention_heads % size:
            out.append(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.{name}={size}; "
                f"heads are split over those ranks"
            )
    if spec is None:
        return  # an unregistered strategy is reported by _replay; its sizes are unknown
    out.extend(spec.check_config(cfg, world))
    sizes = spec.parallel_sizes(cfg)
    mp = spec.model_parallel_size(cfg)
    if world % mp:
        names = "*".join(sizes)
        values = "*".join(str(v) for v in sizes.values())
        out.append(
            f"parallel sizes do not divide the world: {names} = {values} = {mp} (the ranks the {spec.name} strategy "
            f"needs for one copy of the data) does not divide world size {world} (trainer.devices * "
            f"trainer.num_nodes, or WORLD_SIZE); change the sizes or the process count"
        )
    else:
        dp = world // mp
        tr = cfg.trainer
        if tr.prompts_per_step % dp:
            out.append(
                f"trainer.prompts_per_step={tr.prompts_per_step} does not split over {dp} data-parallel "
                f"ranks; set it to a multiple of {dp}"
            )
        elif tr.minibatches_per_step > (tr.prompts_per_step // dp) * max(1, tr.group_size):
            out.append(
                f"trainer.minibatches_per_step={tr.minibatches_per_step} exceeds the "
                f"{(tr.prompts_per_step // dp) * tr.group_size} trajectories each data-parallel rank holds; lower it"
            )


def _model(cfg: RecipeConfig, out: list[str]) -> None:
    m, t = cfg.model, cfg.task
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_key_value_heads"):
        if getattr(m, name) < 1:
            out.append(f"model.{name}={getattr(m, name)} must be >= 1")
    if m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        out.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}"
        )
    if m.num_key_value_heads >= 1 and m.num_attention_heads % m.num_key_value_heads:
        out.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads}"
        )
    longest = t.max_prompt_len + cfg.generation.max_new_tokens
    if m.max_position_embeddings < longest:
        out.append(
            f"model.max_position_embeddings={m.max_position_embeddings} is shorter than the longest sequence "
            f"(task.max_prompt_len + generation.max_new_tokens = {longest}); raise it"
        )
    if m.num_experts < 0 or (m.num_experts and not 1 <= m.moe_top_k <= m.num_experts):
        out.append(
            f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts={m.num_experts}] (num_experts 0 = dense)"
        )
    if m.dtype not in _DTYPES:
        out.append(f"model.dtype={m.dtype!r} must be one of {', '.join(_DTYPES)}")


def _loop(cfg: RecipeConfig, out: list[str]) -> None:
    tr, task = cfg.trainer, cfg.task
    positive = ("steps", "prompts_per_step", "micro_batch_size", "minibatches_per_step", "devices", "num_nodes")
    for name in positive:
        if getattr(tr, name) < 1:
            out.append(f"trainer.{name}={getattr(tr, name)} must be >= 1")
    if tr.group_size < 2:
        out.append(
            f"trainer.group_size={tr.group_size}: GRPO advantages compare responses to the same prompt, so a "
            f"group needs at least 2; set trainer.group_size >= 2"
        )
    if not 0 < tr.lr <= LR_MAX:
        out.append(f"trainer.lr={tr.lr} must be in (0, {LR_MAX:g}] (larger steps overflow the float32 optimizer update)")
    if not tr.clip_eps > 0:
        out.append(f"trainer.clip_eps={tr.clip_eps} must be > 0")
    for name, zero in (("kl_coef", "keeps KL as a diagnostic only"), ("weight_decay", "disables it"), ("grad_clip", "disables clipping")):
        if getattr(tr, name) < 0:
            out.append(f"trainer.{name}={getattr(tr, name)} must be >= 0 (0 {zero})")
    if tr.old_logprobs not in _OLD_LOGPROBS:
        out.append(f"trainer.old_logprobs={tr.old_logprobs!r} must be one of {', '.join(_OLD_LOGPROBS)}")
    if tr.objective not in OBJECTIVES:
        out.append(f"trainer.objective={tr.objective!r} must be one of {', '.join(OBJECTIVES)}")
    elif tr.objective == "tis":
        if not tr.tis_cap > 0:
            out.append(f"trainer.tis_cap={tr.tis_cap} must be > 0 (the largest importance weight)")
        if tr.old_logprobs != "recompute":
            out.append(
                f"trainer.objective=tis with trainer.old_logprobs={tr.old_logprobs!r}: the weight exp(old - rollout) "
                f"is then 1 everywhere; set trainer.old_logprobs=recompute (the trainer's old-policy pass), or "
                f"trainer.objective=token_ratio"
            )
    if tr.accelerator not in _ACCELERATORS:
        out.append(f"trainer.accelerator={tr.accelerator!r} must be one of {', '.join(_ACCELERATORS)}")
    _num_threads(tr.num_threads, out)
    from nemo_replay.trainer.tasks import TASKS

    if task.name not in TASKS:
        out.append(f"task.name={task.name!r} is not a built-in task; choose one of {', '.join(sorted(TASKS))}")
    if task.num_symbols is not None and not 2 <= task.num_symbols <= cfg.model.vocab_size:
        out.append(
            f"task.num_symbols={task.num_symbols} must be in [2, model.vocab_size={cfg.model.vocab_size}]; "
            f"or null for the whole vocabulary"
        )
    if not 1 <= task.min_prompt_len <= task.max_prompt_len:
        out.append(
            f"task.min_prompt_len={task.min_prompt_len}, task.max_prompt_len={task.max_prompt_len}: need "
            f"1 <= min_prompt_len <= max_prompt_len"
        )


def _long_run(cfg: RecipeConfig, out: list[str]) -> None:
    tr = cfg.trainer
    if not 0 <= tr.seed <= SEED_MAX:
        out.append(f"trainer.seed={tr.seed} must be in [0, {SEED_MAX}] (numpy's seed range); pick a seed in that range")
    if tr.resume not in _RESUME:
        # YAML reads yes / no / on / off / true / false as booleans before the str field sees them.
        came = (f"{tr.resume} (a YAML boolean: yes, no, on, off, true and false read as one)"
                if tr.resume in ("True", "False") else repr(tr.resume))
        out.append(f"trainer.resume={came} must be one of {', '.join(_RESUME)}")
    elif tr.resume == "must" and tr.output_dir is None:
        out.append(
            "trainer.resume=must needs trainer.output_dir: the folder of the run to continue "
            "(trainer.output_dir=null always starts a new folder)"
        )
    for name, zero in (("checkpoint_every", "checkpoints only on a stop signal"), ("keep_checkpoints", "keeps every checkpoint")):
        if getattr(tr, name) < 0:
            out.append(f"trainer.{name}={getattr(tr, name)} must be >= 0 (0 {zero})")
    if not tr.collective_timeout_s > 0:
        out.append(f"trainer.collective_timeout_s={tr.collective_timeout_s} must be > 0 (seconds; e.g. 300)")
    for problem in (pretrained_problem(cfg.model.pretrained), output_dir_problem(tr.output_dir)):
        if problem:
            out.append(problem)
    from nemo_replay.trainer.loggers import logger_problems  # plain data: no logger package is imported

    out.extend(logger_problems(tr.loggers))


def _non_finite(cfg: RecipeConfig) -> dict[str, float]:
    """The float flags holding NaN or an infinity, by dotted path."""
    bad = {}
    for path, _, _ in flag_docs():
        node = cfg
        for part in path.split("."):
            node = getattr(node, part)
        if isinstance(node, float) and not math.isfinite(node):
            bad[path] = node
    return bad


def collect_problems(cfg: RecipeConfig, world_size: Optional[int] = None) -> list[str]:
    """Every violated rule of ``cfg`` for a run of ``world_size`` processes (see module doc)."""
    out: list[str] = []
    world = resolve_world_size(cfg, world_size)
    _replay(cfg, out)
    _sampling(cfg, out)
    _engine(cfg, world, out)
    _parallel(cfg, world, out)
    _model(cfg, out)
    _loop(cfg, out)
    _long_run(cfg, out)
    bad = _non_finite(cfg)
    if bad:
        # A range check may also have tripped on the value (nan > 0 is False): one line per flag.
        out = [p for p in out if not any(p.startswith(f"{path}=") for path in bad)]
        for path, value in bad.items():
            out.insert(0, f"{path}={value} must be a finite number (NaN and infinity are refused); set a finite value")
    return out


def validate(cfg: RecipeConfig, world_size: Optional[int] = None) -> RecipeConfig:
    """Raise one :class:`ConfigError` listing every problem of ``cfg``; return ``cfg`` when clean."""
    problems = collect_problems(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    return cfg
