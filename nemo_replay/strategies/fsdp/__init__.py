"""The ``fsdp`` replay strategy: Hugging Face causal LMs under FSDP2, padding removal and
Ulysses sequence parallelism (docs/design.md §5).

    from nemo_replay import get_strategy
    strategy = get_strategy("fsdp").factory(sp_group=sp_group, remove_padding=True)
    outputs = strategy.run_role("policy", model, micro_batches, RoleSettings(source="hidden"))
"""

from nemo_replay.strategies.fsdp import recipe
from nemo_replay.strategies.fsdp.strategy import FSDPStrategy
from nemo_replay.strategies.registry import StrategySpec

__all__ = ["SPEC", "FSDPStrategy"]

SPEC = StrategySpec(
    "fsdp",
    FSDPStrategy,
    "Hugging Face causal LMs under FSDP2: padding removal and Ulysses sequence parallelism",
    parallel_sizes=recipe.parallel_sizes,
    check_config=recipe.check_config,
    trainer_backend="nemo_replay.trainer.backends.hf:HFBackend",
)
