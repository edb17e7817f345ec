"""Where each canonical token sits in a Megatron-Core micro-batch (docs/design.md §3, §5).

A :class:`TokenMetadataLayout` is built once per micro-batch from the canonical attention
mask and explicit parallel sizes. It is a pure function of those inputs: no process
group is read here (gathering over context parallelism takes an explicit group).

Modes
-----
unpadded (``packed=False``): each row keeps one trajectory, its real tokens moved to the
front, rows padded at the end to a multiple of the alignment (``tp``; ``lcm(tp, 16)``
under FP8). Local shape ``(B, S_out)``. Causal attention never lets a real token see
the trailing padding, so no attention mask is needed.

packed THD (``packed=True``): one row ``[seq0, pad0, seq1, pad1, ...]``; sequence ``i`` is
padded to ``Lp_i``, a multiple of ``tp`` (no CP) or ``2*tp*cp`` (CP), and under FP8 of
``lcm(that, 16*cp)``. ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` are the
offsets megatron-core's ``PackedSeqParams`` takes. Context parallel: each padded
sequence is cut into ``2*cp`` equal chunks and rank ``r`` keeps chunks ``r`` and
``2*cp-1-r`` (the load-balanced split Transformer Engine's THD attention expects), so the
local row holds ``T / cp`` tokens.

Coordinates
-----------
Every local slot holds (trajectory b, position q) with q counted from b's first real
token, or padding. Three kinds of channel move through the layout:

- token channels ``[B, S, ...]`` (input ids, MoE routes): slot (b, q) takes canonical
  column ``start_b + q``; no shift.
- logit channels ``[B, S-1, ...]`` (sampled ids, support row ids, loss mask): the logit
  at slot (b, q) predicts token q + 1 of the same trajectory, i.e. canonical logit
  column ``start_b + q``; it exists only for ``q < L_b - 1``. This is the next-token shift
  *inside each padded sequence*: the target of slot p is the token at slot p + 1 of the
  same padded sequence, never the first token of the next one.
- packed channels (one row per token of a span of each trajectory, e.g. ``R_b`` support
  rows starting at logit position ``P_b - 1``, or ``L_b`` MoE route rows starting at
  token 0): slot (b, q) takes row ``cu[b] + q - offset_b`` when that lies in b's span.

Worked example: tp=1, cp=2, packed, two trajectories of L = 5 and 3 real tokens
(a0..a4, b0..b2). Alignment 2*tp*cp = 4, so Lp = 8 and 4, cu_seqlens [0, 5, 8],
cu_seqlens_padded [0, 8, 12]; chunks have 8/4 = 2 and 4/4 = 1 tokens:

    global slot    0  1  2  3  4  5  6  7 | 8  9  10 11
    token          a0 a1 a2 a3 a4 _  _  _ | b0 b1 b2 _
    chunk          0  0  1  1  2  2  3  3 | 0  1  2  3
    rank 0 keeps chunks 0, 3:  a0 a1 _  _  b0 _      (global slots 0 1 6 7 8 11)
    rank 1 keeps chunks 1, 2:  a2 a3 a4 _  b1 b2     (global slots 2 3 4 5 9 10)
    logit at a3 (rank 1, local slot 1) predicts a4; at a4 predicts nothing (q = L - 1).
    With prompt length P_a = 2, support rows s0 s1 s2 of a's response a2 a3 a4 sit at
    the logits of a1 a2 a3: rank 0 local slot 1, rank 1 local slots 0 and 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nemo_replay.layout.canonical import real_runs
from nemo_replay.layout.context_parallel import cp_local_positions
from nemo_replay.layout.slots import Slots
from nemo_replay.support.packed import PackedTensor

__all__ = ["TokenMetadataLayout", "layout_alignment"]


def _round_up(x: torch.Tensor, m: int) -> torch.Tensor:
    return (x + m - 1) // m * m


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def layout_alignment(*, tp_size: int, cp_size: int = 1, fp8: bool = False, packed: bool = False) -> int:
    """The multiple each row (unpadded) or each sequence (packed) is padded to.

    unpadded: ``tp``, or ``lcm(tp, 16)`` under FP8. packed: ``tp`` without CP, ``2*tp*cp``
    with CP, and under FP8 ``lcm(that, 16*cp)`` (every rank's share a multiple of 16).
    Example: tp=2, cp=2, fp8 -> lcm(8, 32) = 32.
    """
    if not packed:
        return math.lcm(tp_size, 16) if fp8 else tp_size
    base = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    return math.lcm(base, 16 * cp_size) if fp8 else base


def _runs(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First real column and number of real tokens of each row; rejects multi-trajectory rows."""
    am = attention_mask
    if am.dim() != 2:
        raise ValueError(f"attention_mask must be (B, S), got shape {tuple(am.shape)}")
    if am.dtype.is_floating_point:
        raise ValueError(f"attention_mask must be bool or integer (1 on real tokens), got {am.dtype}")
    if am.dtype != torch.bool:
        several = torch.nonzero((am < 0) | (am > 1))
        if several.numel():
            b, c = (int(v) for v in several[0])
            raise ValueError(
                f"attention_mask row {b} holds value {int(am[b, c])} at column {c}: a packed row with several "
                f"trajectories (segment ids) cannot be expressed by the layout. Pass one trajectory per row "
                f"(0/1 mask, padded on either side as in ReplayBatch); packed=True packs them into THD sequences itself"
            )
    starts, ends = real_runs(am)  # one contiguous run per row, named when not
    return starts, ends - starts


@dataclass(frozen=True, eq=False)
class TokenMetadataLayout:
    """The token layout of one micro-batch on one (tp, cp) rank. Build with :meth:`build`.

    Attributes:
        packed: THD packing (True) or unpadded rows (False).
        tp_size, cp_size, cp_rank, fp8: the inputs the layout was built for.
        alignment: the padding multiple (:func:`layout_alignment`).
        seq_len: canonical S.
        starts: (B,), int64. Canonical column of each trajectory's first real token.
        lengths: (B,), int64. ``L_b``, real tokens per trajectory.
        padded_lengths: (B,), int64. ``Lp_b``; in unpadded mode every entry is ``S_out``.
        cu_seqlens: (B + 1,), int32. Offsets of the real lengths (packed mode's
            ``cu_seqlens_q``; also defined in unpadded mode).
        cu_seqlens_padded: (B + 1,), int32. Offsets of the padded lengths.
        local_shape: ``(B, S_out)`` unpadded, ``(1, T / cp)`` packed.
        slot_trajectory: (N_local,), int64. Trajectory at each local slot (row-major over
            ``local_shape``), -1 on padding.
        slot_position: (N_local,), int64. Position q within that trajectory, -1 on padding.
    """

    packed: bool
    tp_size: int
    cp_size: int
    cp_rank: int
    fp8: bool
    alignment: int
    seq_len: int
    starts: torch.Tensor
    lengths: torch.Tensor
    padded_lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    local_shape: tuple[int, int]
    slot_trajectory: torch.Tensor
    slot_position: torch.Tensor

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        attention_mask: torch.Tensor,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
        fp8: bool = False,
        packed: bool = False,
        min_length: Optional[int] = None,
    ) -> "TokenMetadataLayout":
        """Lay out a canonical micro-batch for one rank.

        Args:
            attention_mask: (B, S), bool or 0/1 integer. One contiguous run of real tokens
                per row (left-, right- or both-side padding, as ReplayBatch allows).
            tp_size, cp_size, cp_rank: tensor / context parallel sizes and this rank's CP index.
            fp8: FP8 alignment (multiples of 16 tokens per rank).
            packed: THD packing; required when ``cp_size > 1``.
            min_length: pad to at least this many tokens per row (unpadded) or in total
                (packed, the extra padding goes to the last sequence); pipeline parallel
                schedules need one shape for every micro-batch.
        """
        tp_size = _positive_int("tp_size", tp_size)
        cp_size = _positive_int("cp_size", cp_size)
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
        if cp_size > 1 and not packed:
            raise ValueError(
                f"context parallelism (cp_size={cp_size}) needs packed THD sequences: unpadded rows cannot be "
                f"cut into the 2*cp load-balanced chunks Transformer Engine expects. Set packed=True "
                f"(megatron: packed sequences with cu_seqlens_padded) or run with cp_size=1"
            )
        if min_length is not None:
            min_length = _positive_int("min_length", min_length)
        attention_mask = torch.as_tensor(attention_mask).cpu()
        starts, lengths = _runs(attention_mask)
        B, S = attention_mask.shape
        align = layout_alignment(tp_size=tp_size, cp_size=cp_size, fp8=fp8, packed=packed)
        if packed:
            padded = _round_up(lengths, align)
            if min_length is not None and int(padded.sum()) < min_length:
                padded[-1] += int(_round_up(torch.tensor(min_length), align)) - int(padded.sum())
        else:
            width = int(_round_up(lengths.max(), align))
            if min_length is not None:
                width = max(width, int(_round_up(torch.tensor(min_length), align)))
            padded = torch.full((B,), width, dtype=torch.int64)
        cu = torch.zeros(B + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        cup = torch.zeros(B + 1, dtype=torch.int64)
        cup[1:] = torch.cumsum(padded, 0)
        local_shape = (1, int(cup[-1]) // cp_size) if packed else (B, int(padded[0]))
        glob = _global_slots(padded, cup, packed, cp_size, cp_rank)
        traj, pos = _slot_owner(glob, lengths, cup, packed, int(padded[0]))
        return cls(
            packed=bool(packed), tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, fp8=bool(fp8), alignment=align,
            seq_len=S, starts=starts, lengths=lengths, padded_lengths=padded, cu_seqlens=cu.to(torch.int32),
            cu_seqlens_padded=cup.to(torch.int32), local_shape=local_shape, slot_trajectory=traj, slot_position=pos,
        )

    def for_cp_rank(self, cp_rank: int) -> "TokenMetadataLayout":
        """The same micro-batch laid out for another CP rank."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be an int in [0, cp_size={self.cp_size}), got {cp_rank!r}")
        cup = self.cu_seqlens_padded.to(torch.int64)
        glob = _global_slots(self.padded_lengths, cup, self.packed, self.cp_size, cp_rank)
        traj, pos = _slot_owner(glob, self.lengths, cup, self.packed, int(self.padded_lengths[0]))
        return replace(self, cp_rank=cp_rank, slot_trajectory=traj, slot_position=pos)

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    @property
    def num_local(self) -> int:
        return self.local_shape[0] * self.local_shape[1]

    @property
    def total_padded(self) -> int:
        """Tokens of the whole (all CP ranks) padded layout."""
        return int(self.cu_seqlens_padded[-1]) if self.packed else self.num_local

    def global_slots(self) -> torch.Tensor:
        """(N_local,), int64: each local slot's index in the whole padded layout (before the CP split)."""
        cup = self.cu_seqlens_padded.to(torch.int64)
        return _global_slots(self.padded_lengths, cup, self.packed, self.cp_size, self.cp_rank)

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(*self.local_shape, *flat.shape[1:])

    def position_ids(self, device=None) -> torch.Tensor:
        """``local_shape``, int64: position within the trajectory, 0 on padding (model input)."""
        return self._view(self.slot_position.clamp(min=0)).to(device)

    def token_valid(self, device=None) -> torch.Tensor:
        """``local_shape``, bool: slot holds a real token."""
        return self._view(self.slot_trajectory >= 0).to(device)

    def logit_valid(self, device=None) -> torch.Tensor:
        """``local_shape``, bool: slot's logit predicts a real token of its own trajectory."""
        return self._view(self._logit_mask()).to(device)

    def _logit_mask(self) -> torch.Tensor:
        t = self.slot_trajectory
        return (t >= 0) & (self.slot_position < self.lengths[t.clamp(min=0)] - 1)

    def logit_trajectory_ids(self, device=None) -> torch.Tensor:
        """``local_shape``, int64: trajectory of each logit position, -1 where none is predicted."""
        return self._view(torch.where(self._logit_mask(), self.slot_trajectory, -1)).to(device)

    # ------------------------------------------------------------------ channels in
    def slots(self, *, logit: bool) -> Slots:
        """This rank's slots as canonical columns of logit or token channels (:mod:`nemo_replay.layout.slots`)."""
        return Slots.of(
            self.slot_trajectory, self.slot_position, self.starts, self.lengths, seq_len=self.seq_len,
            shape=self.local_shape, logit=logit,
        )

    def _align(self, x: torch.Tensor, fill, logit: bool) -> torch.Tensor:
        width = self.seq_len - 1 if logit else self.seq_len
        kind = "logit" if logit else "token"
        if x.dim() < 2 or tuple(x.shape[:2]) != (self.batch_size, width):
            raise ValueError(
                f"a {kind} channel must be (B={self.batch_size}, {width}, ...) canonical "
                f"{kind} coordinates, got shape {tuple(x.shape)}"
            )
        return self.slots(logit=logit).take(x, fill)

    def align_tokens(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """Token channel ``(B, S, *extra)`` -> ``(*local_shape, *extra)``; ``fill`` on padding."""
        return self._align(x, fill, logit=False)

    def align_logits(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """Logit channel ``(B, S - 1, *extra)`` -> ``(*local_shape, *extra)``; ``fill`` where no logit."""
        return self._align(x, fill, logit=True)

    def packed_row_ids(
        self, cu_seqlens: torch.Tensor | Sequence[int], offsets: torch.Tensor | Sequence[int], *, shift: bool
    ) -> torch.Tensor:
        """Global row of a packed channel at each local slot, ``local_shape`` int64 (-1 none).

        Args:
            cu_seqlens: (B + 1,), int. Row offsets of the packed channel per trajectory.
            offsets: (B,), int. Position within the trajectory of each trajectory's first row
                (support rows: ``P_b - 1``, a logit position; MoE routes: 0, a token position).
            shift: logit positions (True: only slots whose logit predicts a real token) or
                token positions (False: every real token).
        """
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
        off = torch.as_tensor(offsets, dtype=torch.int64).cpu()
        B = self.batch_size
        if cu.shape != (B + 1,) or off.shape != (B,):
            raise ValueError(
                f"packed channel offsets must be cu_seqlens ({B + 1},) and offsets ({B},) for a batch of {B}, got "
                f"{tuple(cu.shape)} and {tuple(off.shape)}"
            )
        n = cu[1:] - cu[:-1]
        self._check_packed_extent(n, off, shift)
        valid = self._logit_mask() if shift else self.slot_trajectory >= 0
        b = self.slot_trajectory.clamp(min=0)
        j = self.slot_position - off[b]
        hit = valid & (j >= 0) & (j < n[b])
        return self._view(torch.where(hit, cu[b] + j, -1))

    def _check_packed_extent(self, n: torch.Tensor, off: torch.Tensor, shift: bool) -> None:
        """Every trajectory's ``n_b`` rows, starting at position ``off_b``, fit its positions.

        Logit positions of trajectory b are ``0 .. L_b - 2`` (the last token predicts nothing),
        token positions ``0 .. L_b - 1``. Example: L_b = 4, support rows at logit positions:
        off_b = 1 with n_b = 2 uses logits 1, 2 (fits); n_b = 3 would need logit 3, which
        predicts no token of b: an error, never a silently dropped row.
        """
        kind = "logit" if shift else "token"
        limit = self.lengths - 1 if shift else self.lengths
        bad = torch.nonzero((n < 0) | (off < 0) | (off + n > limit)).flatten()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"trajectory {b}: {int(n[b])} packed rows starting at {kind} position {int(off[b])} do not fit its "
                f"{int(limit[b])} {kind} positions (L={int(self.lengths[b])} real tokens); rows past the trajectory "
                f"would be dropped. Check the channel's cu_seqlens and offsets against the attention mask"
            )

    def support_row_ids(self, response_lengths: torch.Tensor, support_cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``local_shape`` int64 support row per logit position (-1 none).

        Row j of trajectory b's ``R_b`` response rows sits at the logit of position
        ``L_b - R_b - 1 + j`` (= ``P_b - 1 + j``), which predicts response token j. A response
        needs at least one prompt token before it: ``0 <= R_b <= L_b - 1`` (0: an empty
        response, no row).
        """
        R = torch.as_tensor(response_lengths, dtype=torch.int64).cpu()
        if R.shape != self.lengths.shape:
            raise ValueError(
                f"response_lengths must be ({self.batch_size},), one per trajectory, got shape {tuple(R.shape)}"
            )
        bad = torch.nonzero((R < 0) | (R > self.lengths - 1)).flatten()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"trajectory {b}: response length {int(R[b])} must be in [0, L - 1] with L={int(self.lengths[b])} "
                f"real tokens: the first response token is predicted by the logit of the last prompt token, so a "
                f"response as long as the whole sequence has no logit for its first row. Count the prompt in L"
            )
        return self.packed_row_ids(support_cu_seqlens, self.lengths - R - 1, shift=True)

    def align_packed(self, packed: PackedTensor, offsets, *, shift: bool, fill=-1) -> torch.Tensor:
        """Rows of a packed channel at each local slot: ``(*local_shape, *row_shape)``, ``fill`` where none."""
        rows = self.packed_row_ids(packed.cu_seqlens, offsets, shift=shift).reshape(-1).to(packed.device)
        if packed.num_rows:
            vals = packed.values[rows.clamp(min=0)]
        else:
            vals = packed.values.new_zeros((rows.numel(), *packed.values.shape[1:]))
        keep = (rows >= 0).view(-1, *([1] * (vals.dim() - 1)))
        return self._view(torch.where(keep, vals, torch.full_like(vals, fill)))

    # ------------------------------------------------------------------ channels out
    def to_canonical(self, local: torch.Tensor, fill=0, *, cp_group=None) -> torch.Tensor:
        """Per-logit outputs ``(*local_shape, *extra)`` -> canonical ``(B, S - 1, *extra)``.

        Under CP the local tensors of all ranks are all-gathered over ``cp_group`` (one
        all_gather of a detached copy: for outputs, not the loss path) and every rank
        returns the whole canonical tensor. Positions no rank predicts get ``fill``.
        """
        self._check_local(local)
        if self.cp_size == 1:
            return self.from_cp_parts([local], fill)
        got = None if cp_group is None else dist.get_world_size(cp_group)
        if got != self.cp_size:
            raise ValueError(
                f"to_canonical with cp_size={self.cp_size} needs the context-parallel group of that size, got "
                f"{'no group' if got is None else f'a group of {got} ranks'}; pass cp_group=MegatronParallel.cp_group"
            )
        dtype = local.dtype
        # Masks travel as uint8: not every backend reduces or gathers bool tensors.
        wire = local.detach().to(torch.uint8 if dtype == torch.bool else dtype).contiguous()
        parts = [torch.empty_like(wire) for _ in range(self.cp_size)]
        dist.all_gather(parts, wire, group=cp_group)
        return self.from_cp_parts([p.to(dtype) for p in parts], fill)

    def from_cp_parts(self, parts: Sequence[torch.Tensor], fill=0) -> torch.Tensor:
        """Every CP rank's local outputs (in rank order) -> canonical ``(B, S - 1, *extra)``.

        The scatter half of :meth:`to_canonical`, without communication.
        """
        if len(parts) != self.cp_size:
            raise ValueError(f"expected one local tensor per CP rank ({self.cp_size}), got {len(parts)}")
        for part in parts:
            self._check_local(part)
        extra = tuple(parts[0].shape[2:])
        B, W = self.batch_size, self.seq_len - 1
        device = parts[0].device
        out = torch.full((B * W, *extra), fill, dtype=parts[0].dtype, device=device)
        for r, part in enumerate(parts):
            lay = self if r == self.cp_rank else self.for_cp_rank(r)
            index = lay.slots(logit=True).canonical_index()
            # Integer indices built on the host: a boolean mask on the device would sync to count it.
            held = torch.nonzero(index >= 0).flatten()
            out[index[held].to(device)] = part.reshape(self.num_local, *extra)[held.to(device)]
        return out.view(B, W, *extra)

    def _check_local(self, local: torch.Tensor) -> None:
        if tuple(local.shape[:2]) != self.local_shape:
            raise ValueError(
                f"local outputs must be {self.local_shape} + extra dims (this layout's local_shape), got "
                f"{tuple(local.shape)}; pass outputs of the micro-batch and CP rank this layout was built for"
            )

    # ------------------------------------------------------------------ model inputs
    def input_ids(self, sequences: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
        """``local_shape`` int64 token ids from canonical ``sequences (B, S)``."""
        return self.align_tokens(sequences.to(torch.int64), fill=pad_id)

    def packed_seq_params(self, device=None):
        """megatron-core ``PackedSeqParams`` (``qkv_format='thd'``) for packed mode.

        ``cu_seqlens_q/kv`` are the real lengths, ``*_padded`` the padded ones; both are
        whole-sequence offsets (Transformer Engine partitions them over CP itself).
        """
        if not self.packed:
            raise ValueError("packed_seq_params() exists only for packed=True layouts")
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device)
        cup = self.cu_seqlens_padded.to(device)
        max_len = int(self.padded_lengths.max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup,
            max_seqlen_q=max_len, max_seqlen_kv=max_len,
        )


def _global_slots(padded: torch.Tensor, cup: torch.Tensor, packed: bool, cp: int, r: int) -> torch.Tensor:
    """Index in the whole padded layout of each local slot (see the module example)."""
    if not packed:
        return torch.arange(int(cup[-1]), dtype=torch.int64)
    seq, position = cp_local_positions(padded, cp, r)
    return cup[seq] + position


def _slot_owner(glob: torch.Tensor, lengths: torch.Tensor, cup: torch.Tensor, packed: bool, width: int):
    """(trajectory, position) of each global slot; -1, -1 on padding."""
    if packed:
        seq = torch.searchsorted(cup[1:], glob, right=True)
        pos = glob - cup[seq]
    else:
        seq = glob // width
        pos = glob % width
    real = pos < lengths[seq]
    return torch.where(real, seq, -1), torch.where(real, pos, -1)
