"""Support capture from transformers' ``generate`` (docs/design.md §7).

``model.generate(do_sample=True, ...)`` samples each token from the scores its logits
processors leave: the model's float32 logits of the last position, then the processors
``generate`` builds (suppressed tokens, minimum length, ...) and any the caller passes,
then the sampling warpers -- temperature, top-k, top-p, min-p, in that order
(transformers 5.24, ``generation/utils.py``, ``GenerationMixin._get_logits_processor``).
A caller's processor is merged *before* the warpers, so it cannot see the support. This
module wraps ``_get_logits_processor`` for the duration of one call (:func:`record_support`)
and places two hooks around the whole list:

- the first sees the model's logits ``z`` of the step;
- the last sees the scores ``x`` the token is drawn from (``softmax(x)``): the support is
  every finite entry, the processed log-prob of a member ``s`` is ``x_s - logsumexp(x)``.

Every processor in between may only remove tokens (``-inf``) or shift a whole row: on the
members, ``x - z / T`` must be one constant per row. A processor that rewrites values
(repetition penalty, sequence bias, guidance, watermarking) breaks that, and the trainer
could not reproduce the distribution, so the recorder refuses it naming the step, row and
token. ``generate`` resolves its settings (the caller's, then ``model.generation_config``,
then transformers' defaults such as ``top_k=50``) before it builds the processors; the hook
checks that resolved config before the first token (:func:`check_generation_config`:
greedy decoding, beam search and score-rewriting settings are refused) and takes its
temperature and top-k from it.

The sampled tokens are known only after the step (``generate`` draws with
``torch.multinomial``), so the recorder keeps each step's members and their log-probs, and
:meth:`SupportRecorder.finish` picks the sampled token's entry once the caller hands over
the completions it keeps (cut after a stop token, as the caller cuts them). A step
``generate`` ran past the end of a row (finished rows get pad tokens) is never read.

Rows are ranked (score descending, ties by the smaller id). transformers' top-k keeps every
token tied with the k-th score, so a row can be wider than ``top_k`` where scores tie (the
common case with bf16 logits). Rows are a :class:`RaggedSupport` (CSR), each exactly its
support, never cut, as the capture sampler and the engine adapters return them; with the
resolved top-k their ``width_bound`` is ``top_k`` when every row fits it. A caller that asks
for ``row_width`` gets fixed-width rows of that width (``-1`` padded) when every row fits.

:func:`generate_with_support` runs one batch through ``generate`` under the recorder;
:func:`nemo_replay.trainer.generation.replay_batches_from_generation` turns its result into the trainer's micro-batches.

Worked example, one row, V = 6, temperature 1, top_k = 2, raw logits
``z = [0.1, 2.0, 2.0, 1.5, -1.0, 0.3]``: top-k keeps every score >= the 2nd largest (2.0),
so ``x = [-inf, 2.0, 2.0, -inf, -inf, -inf]``; the row is ``[1, 2]`` (tie: smaller id
first), each member has log-prob ``log 0.5``; with ``top_k = 3`` the row would be
``[1, 2, 3]``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.rollout.capture.sampler import check_capture_settings
from nemo_replay.support.errors import SupportAlignmentError
from nemo_replay.support.membership import csr_membership
from nemo_replay.support.packed import PackedTensor, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport

__all__ = [
    "CapturedSupport",
    "HFRollout",
    "SupportRecorder",
    "check_generation_config",
    "record_support",
    "generate_with_support",
    "stop_token_ids",
]

#: GenerationConfig fields whose processors rewrite scores (value -> neutral value).
_REWRITING = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "sequence_bias": None,
    "guidance_scale": 1.0,
    "exponential_decay_length_penalty": None,
    "watermarking_config": None,
}
#: Relative tolerance of the per-row check ``x - z/T == const`` on the members.
_VALUE_RTOL = 1e-5


def check_generation_config(generation_config, *, where: str = "transformers generate") -> dict:
    """Refuse generation settings whose samples cannot be replayed; return the sampler's settings.

    Args:
        generation_config: a ``transformers.GenerationConfig``.

    Returns:
        ``dict(temperature, top_k, top_p, min_p)`` with ``top_k=None`` for "no top-k bound"
        (transformers spells it 0 or None) and ``min_p=0.0`` for None.

    Raises:
        ValueError listing every problem: greedy decoding (``do_sample=False``), beam search,
        a temperature that is not > 0, and settings that rewrite scores (module doc).
    """
    gc = generation_config
    problems = []
    if not getattr(gc, "do_sample", False):
        problems.append(
            "do_sample=False is greedy decoding: no distribution was sampled, so none can be replayed; set "
            "do_sample=True (with a temperature > 0)"
        )
    if (getattr(gc, "num_beams", 1) or 1) > 1:
        problems.append(f"num_beams={gc.num_beams}: beam search does not sample each token from its support; set num_beams=1")
    for name, neutral in _REWRITING.items():
        value = getattr(gc, name, neutral)
        if value is not None and value != neutral:
            problems.append(
                f"{name}={value!r} rewrites the scores the token is drawn from, which the trainer does not "
                f"reproduce; set {name}={neutral!r}"
            )
    top_k = getattr(gc, "top_k", None)
    settings = dict(
        temperature=getattr(gc, "temperature", None),
        top_k=None if top_k in (None, 0) else top_k,
        top_p=1.0 if getattr(gc, "top_p", None) is None else gc.top_p,
        min_p=0.0 if getattr(gc, "min_p", None) is None else gc.min_p,
    )
    try:
        check_capture_settings(**settings, where=where)
    except ValueError as exc:
        problems.extend(line.strip()[2:] for line in str(exc).splitlines()[1:])
    if problems:
        raise ValueError(f"{where}: this GenerationConfig cannot be captured:\n  - " + "\n  - ".join(problems))
    return settings


def stop_token_ids(generation_config, extra: Optional[Sequence[int]] = None) -> list[int]:
    """The ids that end a completion: ``generation_config.eos_token_id`` (int or list) plus ``extra``."""
    eos = getattr(generation_config, "eos_token_id", None)
    ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(t) for t in eos])
    return ids + [int(t) for t in (extra or []) if int(t) not in ids]


class CapturedSupport(NamedTuple):
    """What :meth:`SupportRecorder.finish` returns for B completions of lengths ``R_i``.

    Attributes:
        support: one segment of ``R_i`` rows per completion: ``RaggedSupport``, or
            ``PackedTensor`` (values (sum R_i, row_width) int32, -1 padded) when a
            ``row_width`` was asked for and every row fits it. Members in rank order; each
            sampled token is in its row.
        logprobs: (sum R_i,), float32, completion-major: the processed log-prob of each
            sampled token over its row.
        lengths: (B,), int64, the ``R_i``.
    """

    support: Union[PackedTensor, RaggedSupport]
    logprobs: torch.Tensor
    lengths: torch.Tensor

    def logprob_lists(self) -> list[list[float]]:
        """The log-probs split per completion, as Python lists."""
        return [t.tolist() for t in self.logprobs.split(self.lengths.tolist())]


class _Step(NamedTuple):
    members: torch.Tensor  # (M,) int32, row-major, rank order inside each row
    logq: torch.Tensor  # (M,) float32, log-prob of each member
    offsets: torch.Tensor  # (B + 1,) int64 CSR offsets of the B rows


class SupportRecorder:
    """Logits-processor hooks that record each decoding step's support (module doc).

    Args:
        temperature: the temperature the caller expects the warpers to divide by; None takes
            the one ``generate`` resolves. A resolved temperature that differs is an error.
        check_values: verify ``x - z / T`` is constant over each row's members (module doc).

    Use with :func:`record_support`; read the result with :meth:`finish`. ``settings`` holds
    the sampler settings of the last ``generate`` call (:func:`check_generation_config`).
    """

    def __init__(self, temperature: Optional[float] = None, *, check_values: bool = True):
        if temperature is not None:
            check_capture_settings(temperature=temperature, where="SupportRecorder")
        self.expected_temperature = temperature
        self.temperature = None if temperature is None else float(temperature)
        self.settings: Optional[dict] = None
        self.check_values = check_values
        self.steps: list[_Step] = []
        self.fed_back: list[torch.Tensor] = []  # fed_back[t]: (B,) tokens sampled at step t, as fed to step t + 1
        self._raw: Optional[torch.Tensor] = None
        self.first = _Hook(self._see_logits)
        self.last = _Hook(self._see_scores)

    # ------------------------------------------------------------------ hooks
    def configure(self, generation_config) -> None:
        """Check the config ``generate`` resolved and take its temperature (called by the hook)."""
        settings = check_generation_config(generation_config, where="support capture (resolved GenerationConfig)")
        T = float(settings["temperature"])
        if self.expected_temperature is not None and not math.isclose(T, self.expected_temperature, rel_tol=1e-6):
            raise ValueError(
                f"support capture: generate resolved temperature={T} but the recorder was told "
                f"{self.expected_temperature}; the trainer would score with the wrong temperature -- pass the "
                f"same temperature to generate and to the trainer"
            )
        self.settings, self.temperature = settings, T

    def _see_logits(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.steps:
            self.fed_back.append(input_ids[:, -1].detach().to("cpu", torch.int64))
        self._raw = scores.detach().clone() if self.check_values else None
        return scores

    def _see_scores(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature is None:
            raise ValueError("SupportRecorder: no temperature; use it through record_support(), or pass temperature=")
        step = len(self.steps)
        x = scores.detach().float()
        counts = torch.isfinite(x).sum(1)
        broken = torch.isnan(x).any(1) | (x == math.inf).any(1) | (counts == 0)
        any_broken, width = torch.stack([broken.any().to(counts.dtype), counts.max()]).tolist()  # one host read
        if any_broken:
            r = int(torch.nonzero(broken)[0])
            raise ValueError(
                f"support capture, step {step}, row {r}: the processed scores hold NaN or +inf, or no finite "
                f"value; the model output or a logits processor is broken at that position"
            )
        vals, ids = torch.topk(x, width, dim=1)  # every finite entry of a row is among its top `width`
        ids, perm = torch.sort(ids, dim=1)  # ties by the smaller id: id-sorted, then a stable sort on score
        vals = vals.gather(1, perm)
        order = torch.sort(vals, dim=1, descending=True, stable=True).indices
        vals, ids = vals.gather(1, order), ids.gather(1, order)
        keep = torch.isfinite(vals)  # a prefix of each row
        if self._raw is not None:
            self._check_values(step, x, ids, vals, keep)
        logq = vals - torch.logsumexp(x, dim=1, keepdim=True)
        self.steps.append(
            _Step(
                ids[keep].to("cpu", torch.int32),
                logq[keep].to("cpu", torch.float32),
                lengths_to_cu_seqlens(counts.cpu()).to(torch.int64),
            )
        )
        return scores

    def _check_values(self, step: int, x, ids, vals, keep) -> None:
        """Members must keep their logit over the temperature, up to one shift per row."""
        z = self._raw.float().gather(1, ids) / self.temperature
        diff = torch.where(keep, vals - z, 0.0)
        shift = diff[:, :1]
        bad = keep & ((diff - shift).abs() > _VALUE_RTOL * (1.0 + z.abs()))
        if bad.any():
            r, c = (int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(
                f"support capture, step {step}, row {r}: the sampled scores differ from the logits over the "
                f"temperature by {float(shift[r, 0]):.6g} for the top token {int(ids[r, 0])} but by "
                f"{float(diff[r, c]):.6g} for token {int(ids[r, c])}; a logits processor rewrote the scores "
                f"(repetition penalty, sequence bias, a custom processor), which no trainer pass reproduces -- "
                f"remove it, or only mask tokens"
            )

    # ------------------------------------------------------------------ result
    def finish(
        self,
        completions: Sequence[Union[Sequence[int], torch.Tensor]],
        *,
        row_width: Optional[int] = None,
        vocab_size: Optional[int] = None,
    ) -> CapturedSupport:
        """Rows and log-probs of the tokens the caller keeps.

        Args:
            completions: B token lists (or 1-D int tensors), row ``i`` of the batch given to
                ``generate``: the ``R_i`` tokens sampled at steps ``0 .. R_i - 1`` that the
                caller keeps (e.g. cut after the first stop token).
            row_width: fixed row width; None (default): CSR rows, whose padded copies are
                the resolved top-k wide when every row fits it. Any row wider than the
                width (ties) gives CSR rows.
            vocab_size: ids must be below it when given.

        Raises:
            ValueError when a completion is longer than the steps recorded or holds a token
            other than the one fed back to the model at that step; SupportAlignmentError (a
            ValueError) for a token outside its row.
        """
        where = "support capture (transformers generate)"
        B = self.steps[0].offsets.numel() - 1 if self.steps else len(completions)
        if len(completions) != B:
            raise ValueError(f"{where}: {len(completions)} completions for a batch of {B} rows; pass one per generated row, in order")
        tokens = [torch.as_tensor(c, dtype=torch.int64).reshape(-1).cpu() for c in completions]
        lengths = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
        T = int(lengths.max()) if B else 0
        if T > len(self.steps):
            i = int(torch.argmax(lengths))
            raise ValueError(
                f"{where}: completion {i} holds {T} tokens but only {len(self.steps)} decoding steps were recorded; "
                f"was generate called inside record_support() with this recorder?"
            )
        sampled = torch.full((B, T), -1, dtype=torch.int64)  # (B, T): token of row i at step t, -1 past R_i
        for i, t in enumerate(tokens):
            sampled[i, : t.numel()] = t
        self._check_fed_back(sampled, where)
        rows, logprobs = self._pick(sampled, where)
        # Step-major (t, i) rows -> completion-major (i, t): row t * B + i goes to position cu[i] + t.
        owner_i, owner_t = torch.nonzero(sampled >= 0, as_tuple=True)  # row-major: (i, t) ascending
        order = owner_t * B + owner_i
        rows = rows.gather(order)
        logprobs = logprobs[order]
        support = _regroup(rows, lengths)
        widest = int(rows.row_lengths.max()) if rows.num_rows else 0
        if row_width is not None and widest <= row_width:
            support = support.to_padded(row_width)
        elif row_width is None and self.settings is not None and self.settings["top_k"] and widest <= self.settings["top_k"]:
            support = support.bounded(self.settings["top_k"])  # padded copies: the top-k width
        flat = torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.int64)
        validate_support(support, sampled_ids=flat, vocab_size=vocab_size, where=where)
        return CapturedSupport(support, logprobs, lengths)

    def _check_fed_back(self, sampled: torch.Tensor, where: str) -> None:
        """Token t of each completion must be the one ``generate`` fed back after step t."""
        for t in range(min(sampled.shape[1], len(self.fed_back))):
            want = sampled[:, t]
            bad = (want >= 0) & (want != self.fed_back[t])
            if bad.any():
                i = int(torch.nonzero(bad)[0])
                raise ValueError(
                    f"{where}: completion {i}, token {t} is {int(want[i])} but generate sampled "
                    f"{int(self.fed_back[t][i])} at that step; completions and generate's rows are misaligned"
                )

    def _pick(self, sampled: torch.Tensor, where: str) -> tuple[RaggedSupport, torch.Tensor]:
        """All rows of steps ``0 .. T-1`` (step-major, one segment each) and the sampled log-prob of each."""
        B, T = sampled.shape
        lps, members, offsets = [], [], [torch.zeros(1, dtype=torch.int64)]
        for t in range(T):
            st = self.steps[t]
            n = st.offsets.diff()
            row_of = torch.repeat_interleave(torch.arange(B), n, output_size=st.members.numel())
            found, hit = csr_membership(st.members, row_of, sampled[:, t])
            missing = (sampled[:, t] >= 0) & ~found
            if missing.any():
                i = int(torch.nonzero(missing)[0])
                raise SupportAlignmentError(
                    f"{where}: completion {i}, token {t} ({int(sampled[i, t])}) is not a member of the support "
                    f"recorded at that step {st.members[st.offsets[i] : st.offsets[i + 1]].tolist()[:16]}; the "
                    f"completions are not the tokens generate sampled"
                )
            lp = torch.zeros(B, dtype=torch.float32).index_put_((row_of[hit],), st.logq[hit])
            lps.append(lp)
            members.append(st.members)
            offsets.append(st.offsets[1:] + offsets[-1][-1])
        rows = RaggedSupport(
            torch.cat(members) if members else torch.empty(0, dtype=torch.int32),
            torch.cat(offsets),
            torch.arange(B * T + 1, dtype=torch.int32),
        )
        return rows, (torch.cat(lps) if lps else torch.empty(0, dtype=torch.float32))


class _Hook:
    """A logits processor: ``(input_ids (B, S) int64, scores (B, V) float32) -> scores``, unchanged."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self._fn(input_ids, scores)


def _regroup(rows: RaggedSupport, lengths: torch.Tensor) -> RaggedSupport:
    """One segment of ``lengths[i]`` rows per completion."""
    return RaggedSupport(rows.member_ids, rows.row_offsets, lengths_to_cu_seqlens(lengths))


def _generating_model(model):
    """The ``PreTrainedModel`` whose ``generate`` builds the processors (a PEFT wrapper delegates to it)."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not callable(getattr(inner, "_get_logits_processor", None)):
        raise ValueError(
            f"support capture needs a transformers model with GenerationMixin._get_logits_processor (transformers "
            f">= 4.45), got {type(inner).__name__}"
        )
    return inner


@contextlib.contextmanager
def record_support(model, recorder: SupportRecorder) -> Iterator[SupportRecorder]:
    """Place ``recorder``'s hooks first and last in every processor list ``model.generate`` builds.

    Args:
        model: a transformers causal LM (or a PEFT model wrapping one).
        recorder: receives every decoding step of every ``generate`` call made inside.

    The wrap is an attribute of this model object only, removed on exit.
    """
    inner = _generating_model(model)
    had_own = "_get_logits_processor" in vars(inner)
    build = inner._get_logits_processor

    def with_hooks(*args, **kwargs):
        from transformers import LogitsProcessorList

        recorder.configure(kwargs["generation_config"] if "generation_config" in kwargs else args[0])
        processors = build(*args, **kwargs)
        return LogitsProcessorList([recorder.first, *processors, recorder.last])

    inner._get_logits_processor = with_hooks
    try:
        yield recorder
    finally:
        if had_own:
            inner._get_logits_processor = build
        else:
            del inner._get_logits_processor


@dataclass
class HFRollout:
    """What :func:`generate_with_support` returns for B prompt rows.

    Attributes:
        sequences: (B, P + n), int64: ``generate``'s output (left-padded prompts, then n
            steps; finished rows continue with pad tokens).
        completions: B tensors (R_i,), int64 on the CPU: each row's tokens up to and
            including its first stop token (all n when it has none).
        captured: the rows and processed log-probs of those tokens (:class:`CapturedSupport`).
        output: ``generate``'s whole output when the config asks for a dict
            (``return_dict_in_generate=True``: scores, raw logits, ...), else None.
    """

    sequences: torch.Tensor
    completions: list
    captured: CapturedSupport
    output: Optional[object] = None


def cut_at_stop(tokens: torch.Tensor, stops: Sequence[int]) -> list[torch.Tensor]:
    """(B, n) int -> B tensors, each cut after its first token in ``stops`` (kept).

    Example: stops [1], rows [[5, 1, 0], [4, 6, 7]] -> [5, 1], [4, 6, 7].
    """
    tokens = tokens.cpu().to(torch.int64)  # widened: a uint8 buffer would wrap an id >= 256 in the comparison
    B, n = tokens.shape
    hit = torch.isin(tokens, torch.tensor([int(t) for t in stops], dtype=torch.int64)) if stops else torch.zeros_like(tokens, dtype=torch.bool)
    first = torch.where(hit.any(1), hit.to(torch.int8).argmax(1) + 1, n)
    return [tokens[i, : int(first[i])].clone() for i in range(B)]


@torch.no_grad()
def generate_with_support(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config,
    *,
    extra_stop_ids: Optional[Sequence[int]] = None,
    row_width: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> HFRollout:
    """Sample with ``model.generate`` (KV cache as configured) and capture every token's support.

    Args:
        model: a transformers causal LM.
        input_ids: (B, P), int64, left-padded prompts.
        attention_mask: (B, P), bool or int, 0 on the left padding.
        generation_config: a ``transformers.GenerationConfig`` that samples; ``generate``
            fills its unset fields (module doc) and the resolved config is checked
            (:func:`check_generation_config`). Its ``eos_token_id`` (int or list) ends rows.
        extra_stop_ids: more ids that end a completion (kept, with their row).
        row_width: fixed support width; default None, CSR rows (padded copies the resolved
            top-k wide when every row fits it).
        vocab_size: ids must be below it; default ``model.config.vocab_size``.

    Returns:
        :class:`HFRollout`.
    """
    if not hasattr(generation_config, "do_sample") or not hasattr(generation_config, "eos_token_id"):
        raise ValueError(
            f"generate_with_support: generation_config must be a transformers.GenerationConfig, got "
            f"{type(generation_config).__name__}; build one with do_sample=True and the sampler's settings"
        )
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate_with_support: input_ids (B, P) and attention_mask (B, P) expected, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    recorder = SupportRecorder()
    with record_support(model, recorder):
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask.long(), generation_config=generation_config
        )
    sequences = output.sequences if hasattr(output, "sequences") else output
    if recorder.settings is None:
        raise ValueError(
            "generate_with_support: generate never built its logits processors through _get_logits_processor, so "
            "nothing was recorded; this transformers version samples elsewhere -- use transformers 4.45 to 5.x"
        )
    stops = stop_token_ids(getattr(model, "generation_config", None) if generation_config.eos_token_id is None else generation_config, extra_stop_ids)
    completions = cut_at_stop(sequences[:, input_ids.shape[1] :], stops)
    if vocab_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    captured = recorder.finish(completions, row_width=row_width, vocab_size=vocab_size)
    return HFRollout(sequences, completions, captured, None if output is sequences else output)
