"""The recipe flags: typed OmegaConf structured dataclasses (docs/design.md §8).

A recipe YAML maps onto :class:`RecipeConfig`; every leaf is a flag addressed by its dotted
path (``replay.sample_support.top_k``, ``parallel.context``). Each field carries a docstring
right below it; :func:`flag_docs` reads them back so ``nemo-replay flags`` can print the
whole list with defaults.

The schema only types the flags. Cross-flag rules (replay needs capture, CP needs packing,
sizes divide the world, ...) live in :mod:`nemo_replay.trainer.config.validation` and run before any
model is built.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "SampleSupportConfig",
    "ScorerConfig",
    "ReplayConfig",
    "GenerationConfig",
    "ModelConfig",
    "ParallelConfig",
    "TaskConfig",
    "TrainerConfig",
    "RecipeConfig",
    "flag_docs",
]


@dataclass
class SampleSupportConfig:
    """Support capture at sampling time (docs/design.md §2, §7)."""

    enabled: bool = True
    """Keep the support row of every sampled token with the rollout batch. Replay needs it;
    with ``replay.enabled: false`` the rows are dropped either way."""
    top_k: Optional[int] = None
    """null (default): ragged (CSR) rows, each as long as the support it records (under
    ``top_k: 64, top_p: 0.95`` most rows hold a few ids), padded to a fixed width only on
    the device where the scorer wants one. A number: fixed-width rows of that width, -1
    padded, carried through the batch; it must be >= ``generation.top_k`` and needs
    ``generation.top_k`` set."""


@dataclass
class ScorerConfig:
    """How the shared scorer gets its input (docs/design.md §4)."""

    source: str = "logits"
    """``logits``: score the model's (vocab-parallel) logits. ``hidden``: score hidden states
    against the LM-head weight without materialising (tokens, V) logits."""
    chunk_size: int = 8192
    """(position, id) pairs projected per chunk in hidden mode, in [1, 2**31 - 1]; bounds the scorer's memory."""
    compute_entropy: bool = False
    """Also compute the entropy over the support (logged as ``entropy``)."""


@dataclass
class ReplayConfig:
    """Support-conditioned log-prob replay (docs/design.md §1, §6)."""

    enabled: bool = True
    """Score every trainer pass (policy, old-policy recompute, reference) over the recorded
    support. false runs the ordinary full-vocabulary path: the no-replay baseline."""
    strategy: str = "fsdp"
    """Registered strategy: ``fsdp`` (Hugging Face + FSDP2), ``megatron`` (Megatron-Core) or a
    plugin from the ``nemo_replay.strategies`` entry-point group."""
    sample_support: SampleSupportConfig = field(default_factory=SampleSupportConfig)
    """Capture of the support rows at sampling time."""
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    """Scorer input mode and chunking."""
    reference_full_vocab: bool = False
    """Score the reference model over the full vocabulary even with replay on."""
    route_replay: bool = False
    """MoE router replay (R3): the trained forward takes the rollout's expert routes.
    Megatron strategy with an MoE model (``model.num_experts > 0``) only."""


@dataclass
class VLLMEngineConfig:
    """vLLM as the rollout engine (``generation.engine: vllm``; docs/engines.md, "A live vLLM")."""

    memory_share: float = 0.05
    """vLLM's ``gpu_memory_utilization``: the share of the device's memory it reserves for
    weights and KV cache (host memory with vLLM's CPU build), in (0, 1]."""
    url: Optional[str] = None
    """``vllm-server`` only: a vLLM server already running (``http://host:port``, started with
    ``VLLM_SERVER_DEV_MODE=1`` and the flags docs/engines.md lists), which must see the engine's
    weights folder; null: the job starts its own on 127.0.0.1 and stops it at the end."""
    start_timeout: float = 300.0
    """``vllm-server`` only: seconds the job waits for the server it starts to answer ``/health``."""


@dataclass
class GenerationConfig:
    """The rollout engine and its sampler settings (docs/design.md §7)."""

    engine: str = "auto"
    """What samples the rollouts. ``hf``: transformers' ``generate`` with a KV cache on an
    engine copy of the policy weights (synced before every rollout, cast to
    ``generation.dtype``), each token's support recorded after its warpers (temperature,
    top-k, top-p, then min-p). ``trainer``: the trainer's own forward on the whole buffer, no
    KV cache, the capture sampler (min-p, top-k, top-p in vLLM's order): the sampler's
    log-probs match the trainer's to float noise. ``vllm``: a running vLLM (``vllm.LLM``,
    its engine in child processes) whose weights are reloaded from the policy before every
    rollout, supports read from its processed log-probs (needs vLLM installed:
    docs/engines.md). ``vllm-server``: the same over HTTP, a vLLM server
    (``/v1/completions``) the job starts, or ``generation.vllm.url``'s, its weights reloaded
    through the server's ``/collective_rpc``. ``auto``: ``hf`` where the strategy's model
    backend runs Hugging Face models (fsdp), ``trainer`` otherwise (megatron)."""
    dtype: Optional[str] = None
    """Parameter dtype of the ``hf`` and ``vllm`` engines' weights (``float32``, ``bfloat16``,
    ``float16``) while the trainer keeps ``model.dtype``; null: ``model.dtype``. Engine ``trainer``
    samples with the trainer's own weights, so it takes null only."""
    temperature: Optional[float] = 1.0
    """Sampling temperature, > 0. Every trainer role divides its logits by the same value."""
    top_k: Optional[int] = 8
    """Keep the k most likely tokens (> 1); null for no top-k bound (ragged support rows)."""
    top_p: float = 0.95
    """Nucleus threshold in (0, 1]; 1.0 disables top-p."""
    min_p: float = 0.0
    """Keep tokens with probability >= min_p * max probability, in [0, 1); 0 disables."""
    repetition_penalty: float = 1.0
    """Must stay 1.0 under capture: a penalty rewrites logits from the history, which no
    trainer pass reproduces."""
    max_new_tokens: int = 6
    """Tokens sampled per response."""
    stop_token_id: Optional[int] = None
    """A sampled token that ends a response early (kept, with its support row); null: none."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """Settings of the ``vllm`` engine."""


@dataclass
class ModelConfig:
    """The policy model. Built from these fields with random weights unless ``pretrained``."""

    pretrained: Optional[str] = None
    """Local directory of a Hugging Face checkpoint (config.json and weights; fsdp strategy
    only; its own sizes replace the ones below, ``vocab_size`` must match). Hub ids are not
    downloaded. null builds the model from the fields below."""
    vocab_size: int = 32
    """Vocabulary size V."""
    hidden_size: int = 64
    """Model width H."""
    intermediate_size: int = 128
    """MLP width (per expert for MoE)."""
    num_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Query heads; divisible by ``parallel.tensor`` and ``parallel.sequence``."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); divides ``num_attention_heads``."""
    max_position_embeddings: int = 64
    """Longest sequence (prompt + response) the position encoding covers."""
    num_experts: int = 0
    """MoE experts per layer; 0 builds a dense MLP."""
    moe_top_k: int = 2
    """Experts each token is routed to (MoE only)."""
    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16``."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention kernel (``sdpa``, ``eager``, ``flash_attention_2``)."""


@dataclass
class ParallelConfig:
    """Parallel sizes. Their product with the data-parallel size is the world size."""

    tensor: int = 1
    """Tensor-parallel size (megatron)."""
    pipeline: int = 1
    """Pipeline-parallel size (megatron)."""
    context: int = 1
    """Context-parallel size (megatron); > 1 needs ``parallel.packing: true``."""
    expert: int = 1
    """Expert-parallel size (megatron MoE)."""
    sequence: int = 1
    """Ulysses sequence-parallel size (fsdp strategy)."""
    packing: bool = False
    """Pack micro-batches into THD sequences (megatron; needs Transformer Engine on GPU)."""


@dataclass
class TaskConfig:
    """The built-in task with a verifiable reward."""

    name: str = "successor"
    """Task name (see :mod:`nemo_replay.trainer.tasks`)."""
    num_symbols: Optional[int] = None
    """Token ids the task uses, [0, num_symbols); null: the whole ``model.vocab_size``."""
    min_prompt_len: int = 2
    """Shortest prompt, in tokens."""
    max_prompt_len: int = 5
    """Longest prompt, in tokens."""


@dataclass
class TrainerConfig:
    """The reference GRPO loop."""

    steps: int = 150
    """Rollout + update iterations."""
    prompts_per_step: int = 16
    """Prompts per iteration, over all data-parallel ranks."""
    group_size: int = 8
    """Responses sampled per prompt (GRPO group); >= 2."""
    micro_batch_size: int = 64
    """Trajectories per forward/backward on one rank."""
    minibatches_per_step: int = 2
    """Optimizer steps per iteration: each rank splits its rollouts into this many nearly equal
    minibatches (at most one per trajectory)."""
    lr: float = 1.0e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip; 0 disables."""
    objective: str = "token_ratio"
    """The policy loss: ``token_ratio`` (PPO/GRPO clipped surrogate of per-token ratios),
    ``sequence_ratio`` (GSPO: one clipped ratio per trajectory, the geometric mean of its
    tokens'; the GSPO paper clips at 3e-4) or ``tis`` (``token_ratio`` with each token weighted
    by ``min(exp(old - rollout), trainer.tis_cap)``, truncated importance sampling against the
    engine's log-probs; needs ``trainer.old_logprobs: recompute``). Each adds ``kl_coef`` x KL."""
    tis_cap: float = 2.0
    """``objective: tis``: the largest importance weight (> 0)."""
    clip_eps: float = 0.2
    """PPO clip range."""
    kl_coef: float = 0.01
    """Weight of the KL-to-reference penalty; 0 keeps KL as a diagnostic only."""
    old_logprobs: str = "recompute"
    """Old-policy log-probs of the PPO ratio: ``recompute`` (a trainer forward before the
    update) or ``rollout`` (the sampler's recorded log-probs)."""
    seed: int = 1234
    """Seeds weights, prompts and sampling, in [0, 2**32 - 1]; equal seeds give equal runs."""
    accelerator: str = "auto"
    """``cpu``, ``gpu`` or ``auto`` (GPU when CUDA is available)."""
    devices: int = 1
    """Processes per node (under torchrun: its --nproc_per_node)."""
    num_nodes: int = 1
    """Nodes (under torchrun: its --nnodes)."""
    num_threads: Optional[int] = None
    """CPU threads per process (torch.set_num_threads), at most the machine's cores (os.cpu_count());
    null keeps torch's choice."""
    output_dir: Optional[str] = None
    """The run's folder (config.yaml, metrics.jsonl, metrics.png, summary.json, checkpoints/).
    null: a new folder runs/<time>-<strategy>-replay-<on|off>[-<slurm job>], never one that
    exists. Name a folder to be able to resume: the same command continues the run there."""
    resume: str = "auto"
    """What a ``trainer.output_dir`` that already holds a run means. ``auto``: continue from
    its latest complete checkpoint (refused when it has none, or when the recipe differs in
    more than the loop's length and logging). ``never``: refuse a folder that holds a run.
    ``must``: refuse to start unless there is a checkpoint to continue from."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps and after the last one (model, optimizer,
    every RNG state, data position, metrics so far). 0: only when a stop signal arrives."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; an older one is deleted once a newer one is complete.
    0 keeps every checkpoint."""
    collective_timeout_s: float = 300.0
    """Seconds a collective (all-reduce, all-gather, barrier, ...) waits for every rank. A rank
    that stopped or hangs makes the others fail after this long with an error naming the
    collective, instead of waiting forever. Applies to the process groups the run creates."""
    progress_bar: bool = True
    """Show the run's progress on rank 0: a tqdm bar on a terminal; on a file or a pipe, a plain line
    at round step numbers (about twenty a run) and at the last step."""
    plot: bool = True
    """Write metrics.png at the end of the run."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Experiment loggers (Lightning Fabric's), each writing every step's metrics under the run
    folder: ``jsonl`` (metrics.jsonl; always listed: resume, the plots and summary.json read
    it), ``csv`` (csv/metrics.csv), ``tensorboard`` (tensorboard/), ``wandb`` (offline,
    wandb/), ``mlflow`` (file store mlruns/). E.g. ``trainer.loggers=[jsonl,tensorboard]``.
    tensorboard, wandb and mlflow need ``pip install "nemo_replay[<name>]"``. A resumed run
    continues the same run in each."""


@dataclass
class RecipeConfig:
    """A whole recipe: what ``nemo-replay train`` reads."""

    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Replay switch, strategy, capture and scorer."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampler settings."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel sizes."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Built-in task."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """GRPO loop."""


def _attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right below it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_docs(cls: type = RecipeConfig, prefix: str = "") -> list[tuple[str, object, str]]:
    """Every leaf flag of ``cls`` as ``(dotted path, default, docstring)``, in schema order."""
    out = []
    docs = _attribute_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(flag_docs(type(value), path + "."))
        else:
            out.append((path, value, docs.get(f.name, "")))
    return out
