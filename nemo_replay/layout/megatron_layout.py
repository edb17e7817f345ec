"""Moved: Megatron's TokenMetadataLayout lives with its strategy."""

raise ImportError(
    "nemo_replay.layout.megatron_layout moved to nemo_replay.strategies.megatron.layout; "
    "import TokenMetadataLayout and layout_alignment from there"
)
