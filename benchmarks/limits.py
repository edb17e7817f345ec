"""Physical-limit models: the bytes that must move and the flops that must run, over measured rates.

Each model returns seconds; a figure's ``x limit`` is its measured time over this. Notation:
N positions, V vocabulary, H hidden size, P present (position, id) pairs, U distinct ids
among them, b bytes per element of the source (logits, or hidden and weight).

Logits mode, support forward
    P random reads, one cache line each, at the gather rate, plus streaming the support
    rows (4 P bytes) at the read bandwidth:   P / gather + 4 P / read_bw
Logits mode, full-vocabulary forward
    every logit read once:                    N V b / read_bw
Hidden mode, support forward
    the U distinct weight rows and the N hidden rows read once, 2 P H flops:
                                              max((U + N) H b / read_bw, 2 P H / gemm)
Hidden mode, support forward + backward
    forward, the U rows read again for the hidden gradient, the dense (V, H) weight
    gradient written once (the autograd contract returns a full weight-sized tensor),
    6 P H flops:   max((2 U + 2 N) H b / read_bw + V H b / fill_bw, 6 P H / gemm)
Hidden mode, support forward + backward into a persistent gradient buffer
    the same, but only the U touched buffer rows are read and written (a copy's traffic):
                   max((2 U + 2 N) H b / read_bw + 2 U H b / copy_bw, 6 P H / gemm)
Hidden mode, full-vocabulary forward / forward + backward
    the logits GEMM (2 N V H flops; three GEMMs with the backward) at the GEMM rate, or
    the weight read (and gradient written) at bandwidth, whichever is larger.

Not counted in any limit: page faults of fresh allocations (reported separately as the
``fresh_zero`` rate), Python and dispatch overhead, the validation of the rows.
"""

from __future__ import annotations

from benchmarks.machine import Rates

__all__ = [
    "logits_support_fwd",
    "logits_full_fwd",
    "hidden_support_fwd",
    "hidden_support_fwdbwd",
    "hidden_support_sparse_fwdbwd",
    "hidden_full_fwd",
    "hidden_full_fwdbwd",
]


def logits_support_fwd(r: Rates, *, P: int) -> float:
    return P / r.gather + 4 * P / r.read_bw


def logits_full_fwd(r: Rates, *, N: int, V: int, b: int) -> float:
    return N * V * b / r.read_bw


def hidden_support_fwd(r: Rates, *, N: int, H: int, P: int, U: int, b: int) -> float:
    return max((U + N) * H * b / r.read_bw, 2 * P * H / r.gemm)


def hidden_support_fwdbwd(r: Rates, *, N: int, V: int, H: int, P: int, U: int, b: int) -> float:
    moved = (2 * U + 2 * N) * H * b / r.read_bw + V * H * b / r.fill_bw
    return max(moved, 6 * P * H / r.gemm)


def hidden_support_sparse_fwdbwd(r: Rates, *, N: int, H: int, P: int, U: int, b: int) -> float:
    moved = (2 * U + 2 * N) * H * b / r.read_bw + 2 * U * H * b / r.copy_bw
    return max(moved, 6 * P * H / r.gemm)


def hidden_full_fwd(r: Rates, *, N: int, V: int, H: int, b: int) -> float:
    return max(2 * N * V * H / r.gemm, V * H * b / r.read_bw)


def hidden_full_fwdbwd(r: Rates, *, N: int, V: int, H: int, b: int) -> float:
    return max(6 * N * V * H / r.gemm, V * H * b / r.read_bw + V * H * b / r.fill_bw)
