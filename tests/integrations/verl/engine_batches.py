"""Batches for verl 0.9.1's engines, built field for field as verl builds them; the sampler; the reference.

Each fixture follows verl's source (paths relative to the ``verl`` package of the 0.9.1 wheel):

- the rollout batch of ``experimental/agent_loop/agent_loop.py``: prompts left-padded to
  ``prompt_length`` and responses right-padded to ``response_length`` (:752-771),
  ``response_mask = mask * response attention mask``, ``attention_mask`` and ``input_ids`` the
  two concatenated (:779-781), ``position_ids = compute_position_id_with_mask(attention_mask)``
  (:930, ``utils/model.py:240``), ``rollout_log_probs`` zero-padded (:773-776), the keys of
  ``_postprocess`` (:1064-1091); ``uid`` per sample (``trainer/ppo/ray_trainer.py:1481-1483``),
  ``meta_info["temperature"]`` the rollout temperature (:1479);
- ``generation_support``, one uint8 buffer a sample in ``non_tensor_batch`` (the channel
  replay's agent loop adds beside ``routed_experts``, ``ReplayAgentLoopWorker._postprocess``,
  docs/design.md §9.3): the sampler's rows, each with the token sampled from it, in the server's
  compact buffer placed at their response positions (``SampleRows.to_bytes``);
- the engine's batch: ``DataProto.to_tensordict`` then ``left_right_2_no_padding``
  (``ray_trainer.py:1283-1296`` old-policy recompute, :1266-1279 reference, :1327-1366 update),
  with the keys ``TrainingWorker.infer_batch`` / ``train_batch`` inject
  (``workers/engine_workers.py:402-414``, :348-358).

The sampler draws every response token the way an engine with top-k does (docs/design.md §1):
``z / T``, the k best ids ranked, a draw from the softmax over them, float64; it records the row
and ``log q``. A tool turn inserts observation tokens that nobody sampled: no row, out of
``response_mask``. :func:`reference_scores` is the naive float64 replay of a batch, over its rows
read back as ``[B, response_length, K]`` (:func:`support_rows`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

VOCAB = 96
TEMPERATURE = 0.7
TOP_K = 5
PROMPT_LENGTH = 5
RESPONSE_LENGTH = 8


def tiny_llama_config(attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def save_tiny_model(folder: str, seed: int = 0) -> str:
    """A tiny Llama built from a config, saved where verl's ``HFModelConfig(path=...)`` loads it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(folder)
    return folder


def load_float64(folder: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager", torch_dtype=torch.float64)
    return model.eval()


@dataclass
class Rollout:
    """One sample: prompt ids, response ids, per response token its row (or None) and log q (or None)."""

    prompt: list
    response: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    logq: list = field(default_factory=list)


def sample_rollouts(model64, prompts, new_tokens, *, seed: int, observations=None, k: int = TOP_K,
                    temperature: float = TEMPERATURE) -> list[Rollout]:
    """Top-k sampling in float64, one token at a time on the whole sequence (no cache).

    Args:
        prompts: list of prompt id lists; new_tokens: sampled tokens per sample.
        observations: {sample: (after how many sampled tokens, [observation ids])}, a tool turn.
    """
    gen = torch.Generator().manual_seed(seed)
    observations = observations or {}
    out = []
    for i, prompt in enumerate(prompts):
        r = Rollout(list(prompt))
        for step in range(new_tokens[i]):
            if i in observations and observations[i][0] == step:
                for t in observations[i][1]:
                    r.response.append(t)
                    r.rows.append(None)
                    r.logq.append(None)
            with torch.no_grad():
                z = model64(torch.tensor([r.prompt + r.response])).logits[0, -1] / temperature
            support = torch.topk(z, k).indices
            q = torch.softmax(z[support], 0)
            s = int(torch.multinomial(q, 1, generator=gen))
            r.response.append(int(support[s]))
            r.rows.append(support.tolist())
            r.logq.append(float(torch.log(q[s])))
        out.append(r)
    return out


def make_batch(rollouts: list[Rollout], *, k: int = TOP_K, temperature: float = TEMPERATURE,
               flagged: tuple = ()):
    """The ``DataProto`` verl's agent loop hands the trainer, plus ``generation_support`` as replay's
    agent loop writes it: one uint8 buffer a sample (:func:`encode_column`).

    Args:
        flagged: (sample, response position) pairs whose support the rollout could not record:
            an empty row, out of ``response_mask`` (the channel's contract).
    """
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    B = len(rollouts)
    prompts = torch.zeros(B, PROMPT_LENGTH, dtype=torch.int64)
    prompt_mask = torch.zeros(B, PROMPT_LENGTH, dtype=torch.int64)
    responses = torch.zeros(B, RESPONSE_LENGTH, dtype=torch.int64)
    response_attention = torch.zeros(B, RESPONSE_LENGTH, dtype=torch.int64)
    loss_tokens = torch.zeros(B, RESPONSE_LENGTH, dtype=torch.int64)
    support = torch.full((B, RESPONSE_LENGTH, k), -1, dtype=torch.int32)
    rollout_log_probs = torch.zeros(B, RESPONSE_LENGTH, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        P, R = len(r.prompt), len(r.response)
        assert P <= PROMPT_LENGTH and R <= RESPONSE_LENGTH
        prompts[i, PROMPT_LENGTH - P:] = torch.tensor(r.prompt)  # left padding (agent_loop.py:752-757)
        prompt_mask[i, PROMPT_LENGTH - P:] = 1
        responses[i, :R] = torch.tensor(r.response)  # right padding (agent_loop.py:759-764)
        response_attention[i, :R] = 1
        for j, (row, lq) in enumerate(zip(r.rows, r.logq)):
            if row is None or (i, j) in flagged:
                continue
            loss_tokens[i, j] = 1
            support[i, j, : len(row)] = torch.tensor(row, dtype=torch.int32)
            rollout_log_probs[i, j] = lq
    response_mask = loss_tokens * response_attention  # agent_loop.py:779
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)  # :780
    input_ids = torch.cat([prompts, responses], dim=1)  # :781
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "rollout_log_probs": rollout_log_probs,
    }
    non_tensors = {
        "uid": np.array([f"uid-{i}" for i in range(B)], dtype=object),
        "generation_support": encode_column(support, responses, [len(r.response) for r in rollouts]),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": temperature})


def encode_column(rows: torch.Tensor, sampled: torch.Tensor, lengths) -> np.ndarray:
    """The ``generation_support`` column replay's agent loop writes (agent_loop.py ``_postprocess``): sample i's
    first ``lengths[i]`` rows in one compact buffer, as the server encodes a turn (each row with the token
    sampled from it), the recorded ones placed at their response positions (``SampleRows.to_bytes``).

    Args:
        rows: (B, R, K) int32, -1 padded (an all -1 row records nothing). sampled: (B, R) int64, the token
            sampled from each row (``responses`` for an honest batch). lengths: B ints, at most R.
    """
    from nemo_replay.integrations.verl.response_rows import encode_response_rows, object_column
    from nemo_replay.support.rows import SampleRows

    out = []
    for i, n in enumerate(lengths):
        buf = encode_response_rows(rows[i, :n], sampled[i, :n].tolist())
        recorded = torch.nonzero((rows[i, :n] >= 0).any(-1)).flatten().numpy()
        out.append(SampleRows.placed((buf,), recorded, recorded, n).to_bytes())
    return object_column(out)


def response_lengths(batch) -> list:
    """Each sample's response length ``R_i`` (its real response tokens, right padding excluded)."""
    return batch.batch["attention_mask"][:, PROMPT_LENGTH:].sum(1).tolist()


def support_rows(batch, k: int = TOP_K) -> torch.Tensor:
    """(B, response_length, k) int32: ``batch``'s compact column read back, row j of sample i at ``[i, j]``, -1
    padded (members ascending, the order the codec keeps), for the reference and the tests' edits."""
    from nemo_replay.support.rows import SampleRows, batch_rows

    responses = batch.batch["responses"]
    column = batch.non_tensor_batch["generation_support"]
    out = torch.full((*responses.shape, k), -1, dtype=torch.int32)
    for i, n in enumerate(response_lengths(batch)):
        rows, row_ids = batch_rows([SampleRows.from_bytes(column[i])], responses[i:i + 1], torch.tensor([n]), name="t")
        dense = dense_from_compact(rows, row_ids)[0, :n]
        assert not n or int((dense >= 0).sum(1).max()) <= k, "a row wider than k"
        out[i, :n, : min(dense.shape[1], k)] = dense[:, :k]
    return out


def edit_rows(batch, edit, lengths=None) -> None:
    """Re-encode ``batch``'s column after ``edit(rows, sampled)`` on its (B, R, K) rows and (B, R) sampled
    tokens, in place: each row keeps the token it was sampled with while ``responses`` stay, so a moved row
    is one that drifted from its token (what the engines must name). ``lengths``: the rows kept a sample
    (default: its response length)."""
    rows, sampled = support_rows(batch), batch.batch["responses"].clone()
    edit(rows, sampled)
    lengths = response_lengths(batch) if lengths is None else lengths
    batch.non_tensor_batch["generation_support"] = encode_column(rows, sampled, lengths)


def swap_rows(rows: torch.Tensor, sampled: torch.Tensor) -> None:
    """For :func:`edit_rows`: response position 1's row (and its token) swapped between samples 0 and 3."""
    rows[[0, 3], 1] = rows[[3, 0], 1]
    sampled[[0, 3], 1] = sampled[[3, 0], 1]


def engine_batch(batch, *, calculate_entropy: bool, micro_batch_size: int = 2, dynamic_bsz: bool = False,
                 max_token_len: int = 24, **extra):
    """What an engine's ``infer_batch`` / ``train_batch`` receives for ``batch``.

    ``ray_trainer.py:1283-1296``: ``to_tensordict`` and ``left_right_2_no_padding``, then the
    pass's flags; ``engine_workers.py:402-414``: the engine settings TrainingWorker injects.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td, calculate_entropy=calculate_entropy, compute_loss=False, use_remove_padding=extra.pop("use_remove_padding", True),
        use_dynamic_bsz=dynamic_bsz, max_token_len_per_gpu=max_token_len, micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False, **extra,
    )
    return td


def build_engine(cls, model_dir: str, *, sp: int = 1, attn: str = "sdpa", use_remove_padding: bool = True,
                 use_fused_kernels: bool = False, initialize: bool = True):
    """An FSDP2 engine as ``TrainingWorker.__init__`` builds it (``engine_workers.py:136-143``), float32 throughout."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model_config = HFModelConfig(
        path=model_dir, load_tokenizer=False, override_config={"attn_implementation": attn},
        use_remove_padding=use_remove_padding, enable_gradient_checkpointing=False,
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, ulysses_sequence_parallel_size=sp,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_remove_padding=use_remove_padding, use_fused_kernels=use_fused_kernels,
    )
    engine = cls(model_config=model_config, engine_config=engine_config,
                 optimizer_config=FSDPOptimizerConfig(lr=1e-3), checkpoint_config=CheckpointConfig())
    if initialize:
        engine.initialize()
    return engine


def response_view(nested, td) -> torch.Tensor:
    """verl's own read-back of a packed output into ``[B, response_length]`` (``workers/utils/padding.py:97``)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, td)


def reference_scores(model64, tb, temperature: float = TEMPERATURE) -> dict:
    """Naive float64 replay of a batch's tensors ``tb`` (a dict of ``DataProto.batch``'s, with
    ``generation_support`` the (B, response_length, K) rows of :func:`support_rows`): per sample,
    the whole sequence through the model, then :func:`reference_from_logits`.
    Differentiable w.r.t. ``model64``'s parameters.
    """
    logits = []
    for i in range(tb["responses"].shape[0]):
        ids = tb["input_ids"][i][tb["attention_mask"][i].bool()]
        logits.append(model64(ids[None]).logits[0])
    return reference_from_logits(logits, tb, temperature)


def reference_from_logits(logits: list, tb, temperature: float = TEMPERATURE) -> dict:
    """``z[x]/T - logsumexp_{s in row} z[s]/T`` at the logit before each response token, float64.

    Args:
        logits: per sample, ``[L_i, V]`` logits of its real tokens (prompt then response).
        tb: the batch's tensors, ``generation_support`` among them as (B, response_length, K) rows
            (:func:`support_rows`).

    Returns [B, response_length] tensors: ``log_probs`` and ``entropy`` (support distribution;
    0 where the token has no row or is out of ``response_mask``), ``full_vocab`` (verl's
    scoring), ``loss`` mask.
    """
    B, R = tb["responses"].shape
    out = {"log_probs": [], "entropy": [], "full_vocab": []}
    for i in range(B):
        real = tb["attention_mask"][i].bool()
        ids = tb["input_ids"][i][real]
        n_resp = int(tb["attention_mask"][i, PROMPT_LENGTH:].sum())
        P = ids.numel() - n_resp
        z_all = logits[i].to(torch.float64) / temperature
        row_lp, row_ent, row_full = [], [], []
        for j in range(R):
            row = tb["generation_support"][i, j]
            row = row[row >= 0].to(torch.int64)
            zero = torch.zeros((), dtype=torch.float64)
            if j >= n_resp or not bool(tb["response_mask"][i, j]) or row.numel() == 0:
                row_lp.append(zero)
                row_ent.append(zero)
                row_full.append(zero)
                continue
            z = z_all[P - 1 + j]
            x = int(ids[P + j])
            logq = torch.log_softmax(z[row], 0)
            row_lp.append(logq[(row == x).nonzero()[0, 0]])
            row_ent.append(-(logq.exp() * logq).sum())
            row_full.append(torch.log_softmax(z, 0)[x])
        out["log_probs"].append(torch.stack(row_lp))
        out["entropy"].append(torch.stack(row_ent))
        out["full_vocab"].append(torch.stack(row_full))
    res = {k: torch.stack(v) for k, v in out.items()}
    res["loss"] = tb["response_mask"].bool()
    return res


# The batch both engines' tests score: ragged prompts and responses, a tool turn (sample 2:
# observation tokens after its first sampled token) and one position whose support the
# rollout could not record (sample 1, response position 2).
PROMPTS = [[11, 23, 5], [42, 7], [60, 61, 62, 63, 64], [88]]
NEW_TOKENS = [6, 4, 3, 8]
OBSERVATIONS = {2: (1, [90, 91])}
FLAGGED = ((1, 2),)


def sampled_batch(model64):
    """The shared batch, sampled from ``model64`` with top-k (seeded)."""
    rollouts = sample_rollouts(model64, PROMPTS, NEW_TOKENS, seed=3, observations=OBSERVATIONS)
    return make_batch(rollouts, flagged=FLAGGED)


def worker_environment() -> None:
    """What every process running verl's engine here needs first (one thread, the CPU platform)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.integrations.verl.cpu_platform import install, register_ulysses_attention

    install()
    register_ulysses_attention()


def buffer_rows(buf, tokens, k: int) -> torch.Tensor:
    """(len(tokens), k) int32 rows, -1 padded, of one compact buffer whose row j is the support of ``tokens[j]``
    (the server's and ``encode_response_rows``' form), decoded with the sampled tokens checked."""
    from nemo_replay.support.codec import decode_support, header_of

    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    assert header_of(buf).rows == tokens.numel()
    rows = decode_support(buf, sampled_ids=tokens).resegment([0, tokens.numel()])
    assert tokens.numel() == 0 or rows.width_bound <= k
    return rows.to_padded(k).values


def dense_from_compact(rows, row_ids: torch.Tensor) -> torch.Tensor:
    """(B, W, K) int32 rows, -1 padded, of ``response_rows.compact_rows``' output: decoded on the CPU,
    each response position's row placed at it (the engines keep them compact; tests compare)."""
    decoded = rows.decode("cpu", check=True)
    values = decoded.values
    if values.shape[0] == 0:  # no sample holds a row (a validation batch)
        return torch.full((*row_ids.shape, max(int(values.shape[1]), 1)), -1, dtype=torch.int32)
    got = values.index_select(0, row_ids.reshape(-1).clamp(min=0)).reshape(*row_ids.shape, values.shape[1])
    return torch.where(row_ids[..., None] >= 0, got, torch.full_like(got, -1))
