"""Public import paths: one module under both capture names, one home for ConfigError."""

import importlib


import nemo_replay


def test_capture_is_one_module_under_both_names():
    from nemo_replay.capture import sample
    from nemo_replay.rollout.capture import sampler as capture

    assert nemo_replay.capture is capture
    assert importlib.import_module("nemo_replay.capture") is capture
    assert sample is capture.sample


def test_config_error_has_one_home():
    from nemo_replay.trainer.config import ConfigError
    from nemo_replay.trainer.config.errors import ConfigError as Direct

    assert ConfigError is Direct and issubclass(ConfigError, ValueError)
