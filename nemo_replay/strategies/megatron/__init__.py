"""The ``megatron`` strategy: megatron-core GPTModels, TP / CP / PP, MoE route replay.

Modules: :mod:`.recipe` (what the strategy asks of a recipe), :mod:`.parallel` (the one
read of ``parallel_state``), :mod:`.layout` (``TokenMetadataLayout``: where each canonical
token sits on this rank under TP, packing and CP), :mod:`.batch` (a micro-batch laid out,
its channels aligned), :mod:`.steps` (forward-step functions and loss closures),
:mod:`.routing` (MoE router replay), :mod:`.strategy` (``run_role``).
Importing this package does not import megatron-core; running a role does.
"""

from nemo_replay.strategies.megatron import recipe
from nemo_replay.strategies.megatron.parallel import MegatronParallel
from nemo_replay.strategies.megatron.strategy import MegatronReplayStrategy
from nemo_replay.strategies.registry import StrategySpec

__all__ = ["SPEC", "MegatronReplayStrategy", "MegatronParallel"]


def _factory(**options) -> MegatronReplayStrategy:
    return MegatronReplayStrategy(**options)


SPEC = StrategySpec(
    "megatron",
    _factory,
    "megatron-core GPTModel: unpadded or packed THD layout, vocab-parallel scoring, CP/PP, MoE route replay",
    parallel_sizes=recipe.parallel_sizes,
    check_config=recipe.check_config,
    needs_process_group=True,  # megatron-core's parallel state needs torch.distributed even on one rank
    supports_route_replay=True,
    trainer_backend="nemo_replay.trainer.backends.megatron:MegatronBackend",
)
