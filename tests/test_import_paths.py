"""Public import paths: the sampler's short name, one home for ConfigError."""

import importlib


import nemo_replay


def test_capture_is_the_samplers_short_name_without_module_aliasing():
    from nemo_replay.capture import sample
    from nemo_replay.rollout.capture import sampler

    short = importlib.import_module("nemo_replay.capture")
    assert nemo_replay.capture is short and short.__name__ == "nemo_replay.capture"  # a module of its own
    assert sample is sampler.sample
    assert short.__all__ == sampler.__all__
    assert all(getattr(short, name) is getattr(sampler, name) for name in sampler.__all__)


def test_config_error_has_one_home():
    from nemo_replay.trainer.config import ConfigError
    from nemo_replay.trainer.config.errors import ConfigError as Direct

    assert ConfigError is Direct and issubclass(ConfigError, ValueError)
