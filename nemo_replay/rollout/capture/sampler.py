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
2. temperature: ``x = z / T`` in float32 (float64 when the logits are float64 and
   ``ties="index_order"``), divided by a tensor on the logits' device as vLLM does;
3. min-p: keep ``i`` iff ``p_i >= min_p * max_j p_j``, evaluated as
   ``exp(x_i - max_j x_j) >= min_p`` (the ratio does not depend on the normaliser);
4. top-k: keep the ``k`` largest ``x``;
5. top-p: renormalise over the survivors of 3 and 4 (vLLM masks top-k before the softmax
   whose cumulative sum it thresholds) and keep the shortest rank prefix whose mass reaches
   ``top_p``; the top token always stays. The two tie rules accumulate that mass as their
   engine paths do (below), which decides a token whose cumulative mass lands within a
   rounding error of the threshold;
6. sample from the softmax of ``x`` over the survivors ``S``:
   ``log q(i) = x_i - logsumexp_{s in S} x_s``.

Min-p and top-k both keep a prefix of the ranked list defined by ``x`` alone, so their
relative order does not change the result; top-p must come after both. (SGLang's
PyTorch path thresholds top-p on probabilities not renormalised after top-k and applies
min-p last; supports captured from SGLang come from its own sampling mask, see
:mod:`nemo_replay.rollout.engines.sglang`.)

Ranking, ties and rounding. Every filter keeps a prefix of one ranking of the candidates,
so a support row is "the first ``m`` ranked candidates". Which tokens survive at a boundary
where several share one value, and how the top-p mass is summed, depend on the engine path,
so :func:`sample` takes the rule (``ties=``) and names the engine path each one follows
(vLLM 0.33.0 source, ``vllm/v1/sample/ops/``):

- ``ties="index_order"`` (default) -- rank by ``x`` descending, ties by the *smaller* id;
  top-k keeps exactly ``k``; top-p keeps rank ``r`` iff the mass ranked strictly above it
  is ``< top_p``, summed top-down in the compute dtype. This is vLLM's Triton
  top-k/top-p kernel (``topk_topp_triton.py``, ``apply_top_k_top_p_triton``), the path
  ``apply_top_k_top_p`` in ``topk_topp_sampler.py`` takes in vLLM 0.33 whenever Triton is
  importable, and always under Model Runner V2, which the sampling mask needs (vLLM 0.24 /
  0.25 take it only for a step of at least 8 rows, the PyTorch path below for fewer). It
  keeps exactly k and resolves the boundary's duplicates in index order, smaller ids first;
  its top-p has the same top-down meaning (the tokens more probable than a pivot hold
  ``>= top_p``, and ``< top_p`` without the least probable of them) but finds the pivot by
  a bisection (at most 18 steps, tolerance 1e-9) over float32 sums taken tile by tile, an
  order no sort reproduces: a token that close to the nucleus boundary may differ.
- ``ties="keep_tied"`` -- vLLM's PyTorch path (``apply_top_k_top_p_pytorch``, taken when
  Triton is absent, and by vLLM 0.24 / 0.25 for a step of fewer than 8 rows), step for step, in float32 as vLLM's sampler casts the logits
  (``sampler.py``): sort ``x`` ascending with torch's default sort; top-k masks
  ``x < x_(k)`` (every token tied with the k-th value stays, so a support may hold more than
  ``k``); top-p takes the float32 softmax of the sorted, top-k-masked row over the whole
  vocabulary, its ``torch.cumsum`` bottom-up, masks where that sum is ``<= 1 - top_p``
  (``top_p`` a float32 tensor, as vLLM stores it) and always keeps the last (largest)
  entry. Ranking: ``x`` descending, ties in the reverse of the order the sort left them.
  The support's *size* follows from the logits; *which* of several tokens tied at a cut
  survive is decided by that unstable sort and cannot be predicted from the logits (torch's
  default sort keeps ties in no promised order: on CPU it is neither by id nor stable, and
  CUDA runs another algorithm). The same calls on the same device type and torch build give
  the engine's bits (checked on CPU against vLLM's function); across devices ``cumsum``
  itself differs (CPU accumulates float32 in float64; torch's CUDA accumulate type for
  float32 is float32), so a token within an ulp of the threshold may differ. Only the
  engine's reported support is exact: capture from the engine's sampling mask or
  log-probs where it returns them.

On bf16 logits ties at the top-k boundary are the common case (large vocabularies hold
many equal values in their upper tail), so the two rules give different supports for most
rows: capture with the rule of the engine path that will be replayed against.

Output. Rows cost what they hold: a :class:`RaggedSupport` of one segment with ``N`` rows
(CSR: int32 members in rank order, int64 row offsets), each row exactly its support. With
``top_k`` and ``ties="index_order"`` its padded copies are ``top_k`` wide (``width_bound``),
as the engine's fixed-width rows are; ``keep_tied`` rows may be wider than ``top_k``. A
support is never cut to fit a width; a consumer that wants fixed-width rows pads them where
it needs them (``to_padded``, or the scorer on the device).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from nemo_replay.support.checked import record_checked
from nemo_replay.support.packed import lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = ["CaptureResult", "TIE_RULES", "TEMPERATURE_RANGE", "sample", "check_capture_settings", "rank_candidates"]

#: ``ties=`` values of :func:`sample` and the vLLM 0.33 path each reproduces (module doc).
TIE_RULES = {
    "index_order": "vLLM Triton top-k/top-p kernel (vllm/v1/sample/ops/topk_topp_triton.py): exactly k, "
    "boundary ties kept in index order",
    "keep_tied": "vLLM PyTorch top-k/top-p (apply_top_k_top_p_pytorch in vllm/v1/sample/ops/topk_topp_sampler.py): "
    "every token tied with the k-th kept; top-p summed bottom-up in float32; which ties survive a cut is the "
    "engine's unstable sort's choice",
}


class CaptureResult(NamedTuple):
    """What :func:`sample` returns (unpacks as ``ids, logprobs, support``).

    Attributes:
        ids: (N,), int64. The sampled token of each row of logits.
        logprobs: (N,), float32. ``log q(ids)`` under the processed distribution.
        support: ``RaggedSupport`` of one segment with N rows, each row its support.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    support: RaggedSupport


#: The temperatures capture serves (:func:`check_capture_settings`).
TEMPERATURE_RANGE = (0.01, 100.0)


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
    prefix: str = "",
) -> None:
    """Refuse sampling settings under which a captured support cannot be replayed.

    Used by :func:`sample` and by every engine adapter, with the engine's settings
    translated to these names (``top_k=None`` means no top-k bound). All problems are
    collected and reported together. ``where`` names the settings' owner (``"GRPOConfig"``,
    ``"vllm sampling params"``); ``prefix`` is put before a flag the fix tells to set
    (``"sampling_params."`` for a JSON body), so the fix names the caller's own field.

    Raises:
        ValueError naming each offending flag, the value received and the fix.
    """
    errors = []
    if temperature is None or isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        errors.append(
            f"temperature={temperature!r}: capture needs a number > 0 (greedy decoding has no "
            f"distribution to replay); set {prefix}temperature, e.g. 1.0"
        )
    elif not (_finite(temperature) and temperature > 0):
        errors.append(
            f"temperature={temperature!r}: capture needs a finite temperature > 0 (temperature <= 0 "
            f"means greedy decoding); set {prefix}temperature, e.g. 1.0"
        )
    elif not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:
        errors.append(
            f"temperature={temperature!r}: capture serves temperatures in [{TEMPERATURE_RANGE[0]}, "
            f"{TEMPERATURE_RANGE[1]}]: vLLM samples at 0.01 whatever lower value it is sent (SamplingParams), so the "
            f"rollout would not be the distribution replayed, and logits / temperature leave float32's range near 0 "
            f"and past 3.4e38; set {prefix}temperature within it, e.g. 1.0"
        )
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            errors.append(f"top_k={top_k!r}: expected an int > 1 or None (no top-k bound)")
        elif top_k <= 1:
            errors.append(
                f"top_k={top_k}: a top-k bound must be > 1 (top_k=1 is greedy; engines "
                f"spell 'no bound' as 0 or -1, which here is top_k=None); set {prefix}top_k > 1 "
                f"or leave it unset for no bound"
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
                f"replayed; set {prefix}{flag}={neutral} (or unset it)"
            )
    if errors:
        raise ValueError(f"{where}: sampling settings cannot be captured:\n  - " + "\n  - ".join(errors))


def _finite(value: numbers.Real) -> bool:
    """``math.isfinite`` that calls an int too large for a float (a JSON ``1e400`` written out) not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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


def rank_candidates(
    x: torch.Tensor, top_k: Optional[int], ties: str = "index_order"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank the candidates of each row and apply top-k under a tie rule (module doc).

    Args:
        x: (N, V), float tempered logits.
        top_k: the top-k bound (None: all V).
        ties: ``"index_order"`` or ``"keep_tied"``.

    Returns:
        values (N, C) float non-increasing, ids (N, C) int64, kept (N, C) bool: the top-k
        survivors, a prefix of each row. ``"index_order"``: C = min(top_k, V) (or V), all
        kept, ties by the smaller id. ``"keep_tied"``: C = V, kept where ``x >= x_(k)``; the
        row is torch's default ascending sort reversed, the sort vLLM's PyTorch path calls,
        so the order among equal values is the sort's, not the ids'.

    Worked example, x = [[1, 3, 3, 3, 0]], top_k = 2. ``"index_order"``: ids [1, 2],
    values [3, 3], all kept. ``"keep_tied"``: values [3, 3, 3, 1, 0], ids {1, 2, 3} in the
    sort's order then [0, 4]; the 2nd largest value is 3, so kept = [T, T, T, F, F] --
    three tokens for k = 2.
    """
    if ties == "index_order":
        if top_k is not None:
            vals, ids = _top_k_ranked(x, top_k)
        else:
            vals, ids = torch.sort(x, dim=1, descending=True, stable=True)
        return vals, ids, torch.ones_like(vals, dtype=torch.bool)
    # vLLM's call, unstable on purpose: flip(1) of this row is exactly the array it thresholds.
    asc_vals, asc_ids = torch.sort(x, dim=1)
    vals, ids = asc_vals.flip(1), asc_ids.flip(1)
    if top_k is None:
        return vals, ids, torch.ones_like(vals, dtype=torch.bool)
    kth = vals[:, min(top_k, x.shape[1]) - 1 :][:, :1]
    return vals, ids, vals >= kth


def _min_p_keep(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """(N, V) bool: ``exp(x_i - max_j x_j) >= min_p`` for x (N, V) float (module doc, step 3)."""
    return torch.exp(x - x.amax(dim=1, keepdim=True)) >= min_p


def _filter_index_order(
    x: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 3-5 under ``ties="index_order"``: top-p summed top-down in ``x``'s dtype.

    Args:
        x: (N, V), float32 or float64, tempered logits.

    Returns:
        values (N, C) float, ids (N, C) int64, keep (N, C) bool, as :func:`rank_candidates`.
    """
    cand_x, cand_ids, keep = rank_candidates(x, top_k, "index_order")
    keep &= torch.isfinite(cand_x)
    if min_p > 0.0:
        keep &= _min_p_keep(cand_x, min_p)  # the row's maximum is always a candidate
    if top_p < 1.0:
        probs = torch.softmax(cand_x.masked_fill(~keep, -math.inf), dim=1)
        # Mass ranked strictly above each candidate: the exclusive prefix sum.
        above = torch.zeros_like(probs)
        above[:, 1:] = torch.cumsum(probs, 1)[:, :-1]
        # The top token always stays (its mass above is 0, and a top_p below float32's smallest
        # number compares as 0 < 0).
        keep[:, 1:] &= above[:, 1:] < top_p
    return cand_x, cand_ids, keep


def _filter_keep_tied(
    x: torch.Tensor, top_k: Optional[int], top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 3-5 as vLLM 0.33's ``apply_top_k_top_p_pytorch`` computes them (module doc).

    The naive equivalent, one row ``x`` (V,) float32, ``top_p`` a float32 scalar::

        x = where(exp(x - x.max()) >= min_p, x, -inf)      # min-p, before the sort as in vLLM
        asc, idx = x.sort()                                # ascending, torch's default sort
        asc[asc < asc[V - k]] = -inf                       # top-k: ties with the k-th stay
        mass = asc.softmax(-1).cumsum(-1)                  # float32, bottom-up, all V entries
        drop = mass <= 1 - top_p; drop[-1] = False         # the largest entry always stays
        support = idx[~drop & isfinite(asc)]

    Worked example, x = [0, 1, 2, 3] (ids 0-3), top_p = 0.5: the softmax is
    [0.032, 0.087, 0.237, 0.644]; its running sum [0.032, 0.119, 0.356, 1.0] is ``<= 0.5``
    for the first three, so only id 3 stays (it alone holds 0.644 >= 0.5).

    Args:
        x: (N, V), float32, tempered logits. Not modified.

    Returns:
        values (N, V) float32, ids (N, V) int64, keep (N, V) bool: the ascending row
        reversed, as :func:`rank_candidates` ``"keep_tied"`` ranks it; keep is a prefix.
    """
    if min_p > 0.0:
        x = x.masked_fill(~_min_p_keep(x, min_p), -math.inf)
    cand_x, cand_ids, keep = rank_candidates(x, top_k, "keep_tied")
    if top_p < 1.0:
        # vLLM's array: the sorted row with the top-k losers at -inf, ascending.
        asc = cand_x.masked_fill(~keep, -math.inf).flip(1)
        mass = torch.cumsum(torch.softmax(asc, dim=1), dim=1)
        threshold = 1 - torch.full((x.shape[0], 1), top_p, dtype=torch.float32, device=x.device)
        drop = mass <= threshold
        drop[:, -1] = False
        keep &= ~drop.flip(1)
    keep &= torch.isfinite(cand_x)
    return cand_x, cand_ids, keep


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    min_p: float = 0.0,
    ties: str = "index_order",
    generator: Optional[torch.Generator] = None,
) -> CaptureResult:
    """Sample one token per row and record its support (order of operations: module doc).

    Args:
        logits: (N, V), float (any floating dtype; the math runs in float32, or float64
            for float64 input under ``ties="index_order"``). Not modified. ``-inf``
            entries (masked vocabulary) are never members; NaN or ``+inf`` is an error.
        temperature: > 0.
        top_k: the top-k bound; None for none.
        top_p: in (0, 1]; 1.0 disables.
        min_p: in [0, 1); 0.0 disables.
        ties: which tokens survive where several share the boundary value (module doc):
            ``"index_order"`` (vLLM's Triton path: at most ``top_k`` per row) or
            ``"keep_tied"`` (vLLM's PyTorch path, its float32 bottom-up top-p included:
            every token tied with the k-th, so rows may be wider; which of several tokens tied at a
            cut survive is torch's unstable sort's choice, as in the engine, so only the
            engine's reported support is exact). See :data:`TIE_RULES`.
        generator: a ``torch.Generator`` on the logits' device for reproducible draws.

    Returns:
        :class:`CaptureResult` ``(ids (N,) int64, logprobs (N,) float32, support)``.
        Each sampled id is a member of its own row, and ``logprobs`` equals
        ``x[id] - logsumexp(x[row])`` with ``x = logits / temperature``.
    """
    check_capture_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, where="capture.sample")
    if ties not in TIE_RULES:
        raise ValueError(
            f"capture.sample: ties={ties!r}; expected one of {sorted(TIE_RULES)} -- 'index_order' reproduces "
            f"vLLM's Triton top-k/top-p path, 'keep_tied' its PyTorch path"
        )
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"capture.sample: logits must be a floating (N, V) tensor, got {got}")
    N, V = logits.shape
    if V == 0:
        raise ValueError("capture.sample: logits have an empty vocabulary dimension (V = 0)")
    # vLLM casts the logits to float32 and divides by a float32 tensor on their device (a CUDA
    # division by a Python scalar multiplies by its reciprocal instead, off by an ulp).
    compute = torch.float64 if logits.dtype == torch.float64 and ties == "index_order" else torch.float32
    divisor = torch.full((1, 1), temperature, dtype=compute, device=logits.device)
    x = logits.to(compute) / divisor  # a new tensor: the caller's logits stay untouched
    bad = torch.isnan(x) | (x == math.inf)
    bad_rows = bad.any(1) | ~torch.isfinite(x).any(1)
    if bad_rows.any():
        r = int(torch.nonzero(bad_rows)[0])
        raise ValueError(
            f"capture.sample: logits row {r} holds NaN or +inf, or no finite value; the model "
            f"output is broken at that position"
        )

    filter_rows = _filter_index_order if ties == "index_order" else _filter_keep_tied
    cand_x, cand_ids, keep = filter_rows(x, top_k, top_p, min_p)  # (N, C), ranked
    assert bool((keep[:, :1]).all()) and not bool((keep[:, 1:] & ~keep[:, :-1]).any()), "support must be a prefix"

    masked = cand_x.masked_fill(~keep, -math.inf)
    logq = masked - torch.logsumexp(masked, dim=1, keepdim=True)  # -inf outside the support
    pick = torch.multinomial(torch.exp(logq), 1, generator=generator)  # (N, 1) rank of the draw
    ids = cand_ids.gather(1, pick).squeeze(1)
    logprobs = logq.gather(1, pick).squeeze(1).to(torch.float32)

    members = cand_ids[keep].to(torch.int32)  # row-major: rank order inside each row
    row_offsets = lengths_to_cu_seqlens(keep.sum(1).cpu()).to(torch.int64)
    support = RaggedSupport(members, row_offsets.to(logits.device), torch.tensor([0, N], dtype=torch.int32))
    if top_k is not None and ties == "index_order":
        support = support.bounded(top_k)  # the engine's row width (exactly k kept)
    # Correct by construction (docs/design.md §2): distinct ranked candidates below V, padding
    # trailing, the draw one of them. Recorded, so the scorer does not sort the rows again.
    record_checked(support, logits.shape[-1])
    return CaptureResult(ids, logprobs, support)
