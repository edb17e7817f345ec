"""Capture the sampler's support at sampling time (docs/design.md §1, §2, §7).

:func:`sample` is a torch sampler that returns, next to each sampled token, its processed
log-prob and the support it was drawn from. Any generation loop (the package's own
loopback server, a Megatron or Hugging Face inference loop) calls it on the logits of the
last position.

Order of operations. It follows the vLLM V1 sampler (``vllm/v1/sample/sampler.py``
documents the steps: penalties, then temperature, then the argmax-invariant min-p
processor, then top-k and top-p, then sampling):

1. penalties: none allowed (repetition / presence / frequency change the logits in a
   history-dependent way the trainer does not reproduce; :func:`check_capture_settings`
   refuses them);
2. temperature: ``x = z / T`` in float32 (float64 when the logits are float64);
3. min-p: keep ``i`` iff ``p_i >= min_p * max_j p_j``, evaluated as
   ``exp(x_i - max_j x_j) >= min_p`` (the ratio does not depend on the normaliser);
4. top-k: keep the ``k`` largest ``x``;
5. top-p: renormalise over the survivors of 3 and 4 (vLLM masks top-k before the softmax
   whose cumulative sum it thresholds) and keep the token at rank ``r`` iff the mass of the
   survivors ranked above it is ``< top_p`` -- the shortest rank prefix whose mass reaches
   ``top_p``; the top token always stays;
6. sample from the softmax of ``x`` over the survivors ``S``:
   ``log q(i) = x_i - logsumexp_{s in S} x_s``.

Min-p and top-k both keep a prefix of the ranked list defined by ``x`` alone, so their
relative order does not change the result; top-p must come after both. (SGLang's
PyTorch path thresholds top-p on probabilities not renormalised after top-k and applies
min-p last; supports captured from SGLang come from its own sampling mask, see
:mod:`nemo_replay.rollout.adapters`.)

Ranking. Candidates are ranked by ``x`` descending, ties by the smaller token id, so the
same logits always give the same rows. Every filter keeps a prefix of that ranking, so a
support row is "the first ``m`` ranked candidates".

Output. With ``top_k`` set, rows are fixed width: ``int32 [N, top_k]``, members in rank
order then trailing ``-1`` (when min-p / top-p removed some of the ``k``, or ``V < k``),
packed as a :class:`PackedTensor` of one segment. Without ``top_k``, rows are ragged: a
:class:`RaggedSupport` of one segment with ``N`` rows (CSR, members in rank order).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Union

import torch

from nemo_replay.support.packed import PackedTensor, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["CaptureResult", "sample", "check_capture_settings", "rank_candidates"]


class CaptureResult(NamedTuple):
    """What :func:`sample` returns (unpacks as ``ids, logprobs, support``).

    Attributes:
        ids: (N,), int64. The sampled token of each row of logits.
        logprobs: (N,), float32. ``log q(ids)`` under the processed distribution.
        support: ``PackedTensor`` (values (N, top_k) int32, cu_seqlens [0, N]) when top_k is
            set, else ``RaggedSupport`` of one segment with N rows.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    support: Union[PackedTensor, RaggedSupport]


def check_capture_settings(
    *,
    temperature: Optional[float],
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: Optional[float] = 1.0,
    presence_penalty: Optional[float] = 0.0,
    frequency_penalty: Optional[float] = 0.0,
    where: str = "capture",
) -> None:
    """Refuse sampling settings under which a captured support cannot be replayed.

    Used by :func:`sample` and by every engine adapter, with the engine's settings
    translated to these names (``top_k=None`` means no top-k bound). All problems are
    collected and reported together.

    Raises:
        ValueError naming each offending flag, the value received and the fix.
    """
    errors = []
    if temperature is None or isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        errors.append(
            f"temperature={temperature!r}: capture needs a number > 0 (greedy decoding has no "
            f"distribution to replay); set generation.temperature, e.g. 1.0"
        )
    elif not (math.isfinite(temperature) and temperature > 0):
        errors.append(
            f"temperature={temperature!r}: capture needs a finite temperature > 0 (temperature <= 0 "
            f"means greedy decoding); set generation.temperature, e.g. 1.0"
        )
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            errors.append(f"top_k={top_k!r}: expected an int > 1 or None (no top-k bound)")
        elif top_k <= 1:
            errors.append(
                f"top_k={top_k}: fixed-width support rows need top_k > 1 (top_k=1 is greedy; engines "
                f"spell 'no bound' as 0 or -1, which here is top_k=None); set generation.top_k > 1 "
                f"or leave it unset for ragged rows"
            )
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:
        errors.append(f"top_p={top_p!r}: expected a number in (0, 1]; 1.0 disables top-p")
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0.0 <= min_p < 1.0:
        errors.append(f"min_p={min_p!r}: expected a number in [0, 1); 0.0 disables min-p")
    for flag, value, neutral in (
        ("repetition_penalty", repetition_penalty, 1.0),
        ("presence_penalty", presence_penalty, 0.0),
        ("frequency_penalty", frequency_penalty, 0.0),
    ):
        if value is not None and value != neutral:
            errors.append(
                f"{flag}={value!r}: penalties rewrite the logits from the generation history, which "
                f"the trainer does not reproduce, so the recorded support and log-probs could not be "
                f"replayed; set {flag}={neutral} (or unset it)"
            )
    if errors:
        raise ValueError(f"{where}: sampling settings cannot be captured:\n  - " + "\n  - ".join(errors))


def _top_k_ranked(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``c = min(k, V)`` best candidates of each row, ranked; ties go to the smaller id.

    Args:
        x: (N, V), float.

    Returns:
        values (N, c) float and ids (N, c) int64, ``values`` non-increasing along dim 1.

    Worked example, x = [[1, 3, 3, 3, 0]], k = 2: the 2nd largest value is 3; one value is
    greater (none here: 0), so two of the tied 3s are taken, the smallest ids first ->
    ids [1, 2], values [3, 3]. ``torch.topk`` alone may pick any two of ids 1, 2, 3.
    """
    N, V = x.shape
    c = min(k, V)
    kth = torch.topk(x, c, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    greater = x > kth
    ties = x == kth
    need = c - greater.sum(1, keepdim=True)
    chosen = greater | (ties & (torch.cumsum(ties.to(torch.int32), 1) <= need))
    # Exactly c per row; nonzero() walks row-major, so ids come out ascending in each row.
    ids = torch.nonzero(chosen)[:, 1].view(N, c)
    vals = x.gather(1, ids)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def rank_candidates(x: torch.Tensor, top_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank the candidates of each row by value, ties by the smaller id.

    Args:
        x: (N, V), float tempered logits.
        top_k: keep only the best ``top_k`` (None: all V).

    Returns:
        values (N, C) float non-increasing, ids (N, C) int64; C = min(top_k, V) or V.
    """
    if top_k is not None:
        return _top_k_ranked(x, top_k)
    vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
    return vals, ids


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> CaptureResult:
    """Sample one token per row and record its support (order of operations: module doc).

    Args:
        logits: (N, V), float (any floating dtype; the math runs in float32, or float64
            for float64 input). Not modified. ``-inf`` entries (masked vocabulary) are never
            members; NaN or ``+inf`` is an error.
        temperature: > 0.
        top_k: fixed-width rows of this many columns; None for ragged rows.
        top_p: in (0, 1]; 1.0 disables.
        min_p: in [0, 1); 0.0 disables.
        generator: a ``torch.Generator`` on the logits' device for reproducible draws.

    Returns:
        :class:`CaptureResult` ``(ids (N,) int64, logprobs (N,) float32, support)``.
        Each sampled id is a member of its own row, and ``logprobs`` equals
        ``x[id] - logsumexp(x[row])`` with ``x = logits / temperature``.
    """
    check_capture_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, where="capture.sample")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"capture.sample: logits must be a floating [N, V] tensor, got {got}")
    N, V = logits.shape
    if V == 0:
        raise ValueError("capture.sample: logits have an empty vocabulary dimension (V = 0)")
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute) / temperature  # a new tensor: the caller's logits stay untouched
    bad = torch.isnan(x) | (x == math.inf)
    bad_rows = bad.any(1) | ~torch.isfinite(x).any(1)
    if bad_rows.any():
        r = int(torch.nonzero(bad_rows)[0])
        raise ValueError(
            f"capture.sample: logits row {r} holds NaN or +inf, or no finite value; the model "
            f"output is broken at that position"
        )

    cand_x, cand_ids = rank_candidates(x, top_k)  # (N, C), ranked
    keep = torch.isfinite(cand_x)
    if min_p > 0.0:
        keep &= torch.exp(cand_x - cand_x[:, :1]) >= min_p
    if top_p < 1.0:
        probs = torch.softmax(cand_x.masked_fill(~keep, -math.inf), dim=1)
        # Mass ranked strictly above each candidate: the exclusive prefix sum.
        above = torch.zeros_like(probs)
        above[:, 1:] = torch.cumsum(probs, 1)[:, :-1]
        keep &= above < top_p
    assert bool((keep[:, :1]).all()) and not bool((keep[:, 1:] & ~keep[:, :-1]).any()), "support must be a prefix"

    masked = cand_x.masked_fill(~keep, -math.inf)
    logq = masked - torch.logsumexp(masked, dim=1, keepdim=True)  # -inf outside the support
    pick = torch.multinomial(torch.exp(logq), 1, generator=generator)  # (N, 1) rank of the draw
    ids = cand_ids.gather(1, pick).squeeze(1)
    logprobs = logq.gather(1, pick).squeeze(1).to(torch.float32)

    if top_k is not None:
        values = torch.full((N, top_k), -1, dtype=torch.int32, device=logits.device)
        C = cand_ids.shape[1]
        values[:, :C] = cand_ids.masked_fill(~keep, -1)
        support: Union[PackedTensor, RaggedSupport] = PackedTensor(values, [0, N])
    else:
        members = cand_ids[keep].to(torch.int32)  # row-major: rank order inside each row
        row_offsets = lengths_to_cu_seqlens(keep.sum(1).cpu()).to(torch.int64)
        support = RaggedSupport(members, row_offsets.to(logits.device), torch.tensor([0, N], dtype=torch.int32))
    return CaptureResult(ids, logprobs, support)
