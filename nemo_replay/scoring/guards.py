"""The guards of one scorer call (docs/design.md §2, §3, §4).

Each guard is first computed as a device flag, with no host sync; the scorer reads all of
them (and the sizes it needs) in ONE host read. Only when a flag is set does the matching
``raise_*`` function run, which may read the device freely to name the trajectory, the
position and the fix: the failure path is the only one that pays for the message.

    guard           what it catches                                       error
    decode          compact rows decoded on the device that are not what  CodecError
                    the encoder wrote (always on: the rows are garbage)
    row_range       a row id outside [-1, rows)                           ValueError
    id_range        an id of a scored row outside [-1, V): always on,     ValueError
                    whatever ``validate`` or a row's check record skips,
                    since the kernels index the logits / LM-head rows
                    with these ids
    support         rows breaking the §2 invariants (when validating)     ValueError
    synthetic_eos   row-less loss-active positions breaking the §3 rule   SupportAlignmentError
                    (the rule and the naming of positions live in
                    :mod:`nemo_replay.layout.checks`, which strategies also run
                    on whole sequences before slicing them)
    membership      a scored sampled token that is not in its row         SupportAlignmentError
    sampled_vocab   a sampled id outside [0, V) where the vocabulary
                    scores it (synthetic EOS, the full-vocabulary path)   ValueError
"""

from __future__ import annotations


import torch

from nemo_replay.layout.checks import Where
from nemo_replay.support.errors import SupportAlignmentError

__all__ = [
    "GUARDS",
    "raise_row_range",
    "raise_id_range",
    "raise_membership",
    "raise_sampled_vocab",
]

GUARDS = ("decode", "row_range", "support", "id_range", "synthetic_eos", "membership", "sampled_vocab")


def raise_row_range(rows: torch.Tensor, num_rows: int, where: Where) -> None:
    """Name the first position whose row id is outside ``[-1, num_rows)``."""
    p = int(torch.nonzero((rows < -1) | (rows >= num_rows))[0])
    raise ValueError(
        f"{where(p)}: row id {int(rows[p])} outside "
        f"[-1, {num_rows}) for a support of {num_rows} rows; row ids index the support's rows (-1 for none)"
    )


def raise_id_range(bad: torch.Tensor, ids: torch.Tensor, rows, vocab_size, where: Where) -> None:
    """Name the first scored position whose row holds an id outside ``[-1, vocab_size)``, and the id.

    ``bad``: (N,) bool, the scored positions whose row holds one; ``ids``: (N, w) the row of every position.
    """
    p = int(torch.nonzero(bad)[0])
    row = ids[p].to(torch.int64)
    c = int(torch.nonzero((row < -1) | (row >= (2**62 if vocab_size is None else vocab_size)))[0])
    vocab = "V" if vocab_size is None else vocab_size
    raise ValueError(
        f"{where(p)}: its support row {int(rows[p])} holds id "
        f"{int(ids[p, c])}, outside [-1, {vocab}) (-1 pads a row; every other id must be a token of the model's "
        f"vocabulary). The rows were changed after their check, or built without one: rebuild them, or score with "
        f"validate=True on rows that carry no check"
    )


def raise_membership(missing: torch.Tensor, ids: torch.Tensor, sampled, rows, where: Where) -> None:
    """Name the first scored position whose sampled token is not in its row.

    ``missing``: (N,) bool; ``ids``: (N, w) the row of every position.
    """
    p = int(torch.nonzero(missing)[0])
    members = ids[p][ids[p] >= 0][:16].tolist()
    raise SupportAlignmentError(
        f"{where(p)}: sampled token {int(sampled[p])} is not a "
        f"member of its support row {members} (row {int(rows[p])}); token and support coordinates are misaligned "
        f"(support rows sit at logit positions: row j of a response predicts token P + j)"
    )


def raise_sampled_vocab(bad: torch.Tensor, sampled, vocab_size, where: Where) -> None:
    """Name the first position scored over the vocabulary whose sampled id lies outside it.

    ``vocab_size``: int, or None when only a negative id can be known wrong yet (a TP shard
    that does not know the global size, before the MAX all-reduce).
    """
    p = int(torch.nonzero(bad)[0])
    vocab = "V" if vocab_size is None else vocab_size
    raise ValueError(
        f"{where(p)}: sampled id {int(sampled[p])} outside "
        f"the vocabulary [0, {vocab}); sampled ids are the tokens shifted by one, in the model's vocabulary"
    )
