"""Batches, logits and shards built with NeMo-RL's conventions, and float64 references.

Every convention below is NeMo-RL's at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909
(github NVIDIA-NeMo/RL), cited by file and line there; NeMo-RL itself is not importable
here (it needs Python >= 3.13), so the objects are built field for field:

- right padding: ``nemo_rl/data/llm_message_utils.py:269`` ("Padding is always applied to
  the right side of sequences"); the training data dict holds ``input_ids``,
  ``input_lengths``, ``generation_logprobs``, ``token_mask`` and ``sample_mask``
  (``nemo_rl/algorithms/grpo.py:3165-3173``); ``token_mask`` is 1 on generated assistant
  tokens only (``grpo.py:1934-1937``);
- logits are divided by the temperature in place before any post-processor
  (``nemo_rl/models/megatron/train.py:203-217`` and ``327-336``;
  ``nemo_rl/models/automodel/train.py:180-194`` and ``371-385``);
- Megatron vocab-parallel logits ``[.., V / tp]``, rank r holding ``[r V/tp, (r+1) V/tp)``
  (``nemo_rl/distributed/model_utils.py:1655-1660``);
- context parallel: rank r holds chunks r and 2 cp - 1 - r of each padded sequence
  (``model_utils.py:1199-1233``, ``_get_tokens_on_this_cp_rank``);
- packing: each sequence padded to a multiple of the pad factor (2 cp, times tp under
  sequence parallelism: ``nemo_rl/models/megatron/data.py:1284-1296``), CP-sharded on its
  own and concatenated (``data.py:1008-1023``, ``1075-1097``); ``PackedSeqParams`` carries
  the padded offsets as both ``cu_seqlens_q`` and ``cu_seqlens_q_padded``
  (``data.py:1128-1137``);
- the per-sequence loss call: ``SequencePackingLossWrapper`` slices each packed sequence's
  CP-local logits ``[start / cp, (start + P) / cp)`` and cuts every ``[B, S, ...]`` data
  tensor to ``[:, :P]`` with P its (padded) length from ``cu_seqlens_q``
  (``nemo_rl/algorithms/loss/wrapper.py:86-133``), then sums the losses (``144``);
  ``LossPostProcessor`` divides the loss by the CP size (``train.py:574-582``);
- ``ClippedPGLossFn`` reads ``token_mask[:, 1:]``, ``sample_mask``, ``prev_logprobs[:, 1:]``
  and normalises by ``global_valid_toks`` (``nemo_rl/algorithms/loss/loss_functions.py:382-397``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

VOCAB = 64
WIDTH = 6  # support row width k (the sampler's top_k)
TEMPERATURE = 0.7
TOP_P = 0.9
PAD_ID = 0


class LossInputType(enum.Enum):
    """nemo_rl/algorithms/loss/interfaces.py:50-55 (the values the hooks compare)."""

    LOGIT = "logit"
    LOGPROB = "logprob"


@dataclass(frozen=True)
class Traj:
    """prompt / response lengths; ``observation``: response indices that are tool output
    (no row, no loss); ``eos``: the last response token is a synthetic EOS (loss-active, no row)."""

    prompt: int
    response: int
    observation: tuple = ()
    eos: bool = False


TRAJS = [Traj(4, 6, eos=True), Traj(3, 9, observation=(3, 4)), Traj(5, 3), Traj(2, 7)]
SAMPLE_MASK = [1.0, 1.0, 1.0, 0.0]  # the last trajectory is filtered out of the loss


def make_logits(num_rows: int, width: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Raw logits ``[B, W, V]`` with a spread that makes truncation matter."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, width, VOCAB, generator=g, dtype=torch.float64) * 2.5).to(dtype)


def make_batch(seed: int = 0, dtype=torch.float32):
    """A NeMo-RL training micro-batch sampled from its own logits.

    Returns ``(data, raw_logits [B, W, V], sampler_logprobs [B, W], rows [B, W, k])``: ``data`` is
    the dict a worker holds (right-padded ``input_ids [B, W]``, ``input_lengths``, token-aligned
    ``token_mask``, ``sample_mask``, ``generation_logprobs`` and ``generation_support``, one
    :class:`~nemo_replay.support.rows.SampleRows` a sample: :func:`encode_rows`); ``rows`` are the
    same support rows as the sampler drew them, int32, the row of token t at column t, -1 padded
    (the float64 references' ground truth, never handed to the scorer). The logits at column
    t - 1 produced token t, which ``nemo_replay.capture.sample`` drew with top-k / top-p at the
    temperature; distinct prompt ids so a swapped row changes the answer.
    """
    from nemo_replay import capture

    B = len(TRAJS)
    W = max(t.prompt + t.response for t in TRAJS) + 1  # one column of right padding everywhere
    raw = make_logits(B, W, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.full((B, W), PAD_ID, dtype=torch.int64)
    rows = torch.full((B, W, WIDTH), -1, dtype=torch.int32)
    token_mask = torch.zeros(B, W, dtype=torch.float32)
    gen_lp = torch.zeros(B, W, dtype=torch.float32)
    prompts = torch.randperm(VOCAB - 1, generator=g)[: sum(t.prompt for t in TRAJS)] + 1
    start = 0
    for i, t in enumerate(TRAJS):
        ids[i, : t.prompt] = prompts[start : start + t.prompt]
        start += t.prompt
        for j in range(t.response):
            col = t.prompt + j
            if j in t.observation or (t.eos and j == t.response - 1):
                ids[i, col] = int(torch.randint(1, VOCAB, (1,), generator=g))
                token_mask[i, col] = 0.0 if j in t.observation else 1.0
                continue
            got = capture.sample(raw[i, col - 1][None], temperature=TEMPERATURE, top_k=WIDTH, top_p=TOP_P, generator=g)
            ids[i, col] = int(got.ids[0])
            members = [int(m) for m in got.support.to_padded().values[0] if m >= 0]
            rows[i, col, : len(members)] = torch.tensor(members, dtype=torch.int32)
            token_mask[i, col] = 1.0
            gen_lp[i, col] = float(got.logprobs[0])
    lengths = torch.tensor([t.prompt + t.response for t in TRAJS], dtype=torch.int32)
    data = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor(SAMPLE_MASK),
        "generation_support": encode_rows(rows, ids, lengths),
        "generation_logprobs": gen_lp,
    }
    return data, raw, gen_lp, rows


def encode_rows(rows: torch.Tensor, ids: torch.Tensor, lengths, *, width: int = 0, shift: int = 0) -> list:
    """``generation_support`` as the replay data path puts it in NeMo-RL's batches: one
    :class:`~nemo_replay.support.rows.SampleRows` a sample, encoded once with its sampled ids kept
    (as replay's vLLM worker encodes them), its columns those of ``ids``.

    Args:
        rows: (B, W, k) int, the row of token t at column t, -1 padded (an all -1 row: not recorded).
        ids: (B, W) int, the sampled tokens; lengths: (B,) the tokens of each sample.
        width: as ``SampleRows.encode`` (0: ragged rows; k: rows captured at a fixed width).
        shift: place every row ``shift`` columns late (a misaligned slice: the row of token t at
            column t + shift; the rows pushed past a sample's length are dropped).
    """
    from nemo_replay.support.packed import PackedTensor
    from nemo_replay.support.rows import SampleRows

    out = []
    for i in range(ids.shape[0]):
        L = int(lengths[i])
        n = L - shift
        out.append(SampleRows.encode(PackedTensor(rows[i, :n], [0, n]), ids[i, :n], start=shift, length=L, width=width,
                                     where=f"sample {i}"))
    return out


def reference_next_token_logprobs(scaled: torch.Tensor, data: dict, rows: torch.Tensor, *,
                                  full_vocab: bool = False) -> torch.Tensor:
    """Float64 loop: ``[B, W - 1]`` log-probs of loss-active next tokens over their rows (0 elsewhere).

    ``scaled`` are temperature-divided logits ``[B, W, V]`` (differentiable); ``rows`` the dense
    ``(B, W, k)`` rows (:func:`make_batch`). A loss-active token without a row (a synthetic EOS) is
    scored over the full vocabulary.
    """
    ids = data["input_ids"]
    B, W = ids.shape
    out = [[torch.zeros((), dtype=torch.float64) for _ in range(W - 1)] for _ in range(B)]
    for i in range(B):
        L = int(data["input_lengths"][i])
        for c in range(L - 1):
            t = c + 1
            active = data["token_mask"][i, t] != 0 and data["sample_mask"][i] != 0
            if not full_vocab and not active:
                continue
            z = scaled[i, c].to(torch.float64)
            x = int(ids[i, t])
            members = [int(m) for m in rows[i, t] if m >= 0]
            kept = z if (full_vocab or not members) else z[members]
            out[i][c] = z[x] - torch.logsumexp(kept, 0)
    return torch.stack([torch.stack(r) for r in out])


class ClippedPGStyleLoss:
    """The data reads and normalisation of ``ClippedPGLossFn`` (loss_functions.py:382-397),
    with its PPO surrogate: ``-sum(mask * min(r A, clip(r) A)) / global_valid_toks``."""

    input_type = LossInputType.LOGPROB

    def __init__(self, clip: float = 0.2):
        self.clip = clip

    def __call__(self, data, global_valid_seqs, global_valid_toks, next_token_logprobs):
        mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
        prev = data["prev_logprobs"][:, 1:].to(next_token_logprobs.dtype)
        adv = data["advantages"][:, 1:].to(next_token_logprobs.dtype)
        ratio = torch.exp(next_token_logprobs - prev)
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        loss = -(surr * mask.to(surr.dtype)).sum() / global_valid_toks
        return loss, {"loss": float(loss.detach())}


def with_loss_inputs(data: dict, scaled: torch.Tensor, rows: torch.Tensor, seed: int = 3) -> dict:
    """``prev_logprobs`` (old-policy log-probs near the current ones, token-aligned: token t at
    column t, 0 in column 0 as ``LogprobsPostProcessor`` returns them, train.py:668-671) and
    token-aligned ``advantages``; the ratios straddle the clip range."""
    g = torch.Generator().manual_seed(seed)
    B, W = data["input_ids"].shape
    with torch.no_grad():
        current = reference_next_token_logprobs(scaled.double(), data, rows)
    out = dict(data)
    prev = torch.zeros(B, W, dtype=torch.float64)
    prev[:, 1:] = current + 0.25 * torch.randn(B, W - 1, generator=g, dtype=torch.float64)
    out["prev_logprobs"] = prev
    out["advantages"] = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, W).clone()
    return out


# ------------------------------------------------------------------------------ NeMo-RL's layouts


def cp_chunks(x: torch.Tensor, cp: int, r: int, dim: int) -> torch.Tensor:
    """Chunks r and 2 cp - 1 - r along ``dim`` (model_utils.py:1221-1233)."""
    if cp == 1:
        return x
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, r * c, c), x.narrow(dim, (2 * cp - 1 - r) * c, c)], dim)


def vocab_shard(x: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """``[.., V / tp]`` slice of rank r (model_utils.py:1658-1659)."""
    per = x.shape[-1] // tp
    return x[..., r * per : (r + 1) * per]


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def packed_layout(lengths: list[int], pad_factor: int) -> list[int]:
    """cu_seqlens_padded: each sequence padded to a multiple of ``pad_factor`` (data.py:1020-1023)."""
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + round_up(L, pad_factor))
    return cu


def packed_local_logits(scaled: torch.Tensor, lengths: list[int], cu: list[int], cp: int, r: int) -> torch.Tensor:
    """``[1, T / cp, V]``: each sequence's logits padded to its P_i (zeros) and CP-chunked, concatenated.

    The logits of padding slots are whatever the model gives; zeros here (replay never reads them).
    """
    parts = []
    for i, L in enumerate(lengths):
        P = cu[i + 1] - cu[i]
        seq = torch.zeros(P, scaled.shape[-1], dtype=scaled.dtype)
        seq[:L] = scaled[i, :L]
        parts.append(cp_chunks(seq, cp, r, 0))
    return torch.cat(parts, 0)[None]


def per_sequence_data(data: dict, i: int, width: int) -> dict:
    """``SequencePackingLossWrapper``'s slice of row i (wrapper.py:91-97): [B, S, ...] tensors cut to
    ``[:, :width]``, lists sliced to their one entry (``BatchedDataDict.slice``, batched_data_dict.py:905)."""
    out = {}
    for k, v in data.items():
        v = v[i : i + 1]
        out[k] = v[:, :width] if (isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] > 1) else v
    return out


def close_to_zero(x: float) -> bool:
    return math.isfinite(x) and abs(x) < 1e-12
