"""Recipe flags: typed schema, YAML loading with ``defaults:`` inheritance, validation (docs/design.md §8).

    from nemo_replay.trainer.config import load_config
    cfg = load_config("configs/fsdp_gpu.yaml", ["trainer.steps=20"])
"""

from nemo_replay.trainer.config.errors import ConfigError
from nemo_replay.trainer.config.loading import load_config, read_recipe, to_yaml
from nemo_replay.trainer.config.schema import RecipeConfig, flag_docs
from nemo_replay.trainer.config.validation import collect_problems, validate

__all__ = ["ConfigError", "RecipeConfig", "load_config", "read_recipe", "to_yaml", "flag_docs", "collect_problems", "validate"]
