"""Support data model: packed per-trajectory rows, CSR support, invariant checks."""

from nemo_replay.support.packed import PackedTensor, check_cu_seqlens, lengths_to_cu_seqlens
from nemo_replay.support.ragged import RaggedSupport
from nemo_replay.support.validate import validate_support_rows

__all__ = ["PackedTensor", "RaggedSupport", "lengths_to_cu_seqlens", "check_cu_seqlens", "validate_support_rows"]
