"""Public import paths: the ones that moved fail with a message naming the new path."""

import importlib

import pytest

import nemo_replay


@pytest.mark.parametrize(
    "old, new",
    [
        ("nemo_replay.layout.megatron_layout", "nemo_replay.strategies.megatron.layout"),
        ("nemo_replay.trainer.roles", "nemo_replay.roles"),
        ("nemo_replay.trainer.lightning_hook", "nemo_replay.integrations.lightning"),
        ("nemo_replay.trainer.task", "nemo_replay.tasks"),
    ],
)
def test_moved_modules_name_their_new_path(old, new):
    with pytest.raises(ImportError, match=new.replace(".", r"\.")):
        importlib.import_module(old)
    importlib.import_module(new)


@pytest.mark.parametrize("name, new", [("ReplayRoles", "nemo_replay.roles"), ("ReplayCallback", "nemo_replay.integrations.lightning")])
def test_moved_trainer_attributes_name_their_new_path(name, new):
    import nemo_replay.trainer

    with pytest.raises(AttributeError, match=new.replace(".", r"\.")):
        getattr(nemo_replay.trainer, name)


def test_capture_is_one_module_under_both_names():
    from nemo_replay.capture import sample
    from nemo_replay.rollout import capture

    assert nemo_replay.capture is capture
    assert importlib.import_module("nemo_replay.capture") is capture
    assert sample is capture.sample


def test_config_error_has_one_home():
    from nemo_replay.config import ConfigError
    from nemo_replay.config.errors import ConfigError as Direct

    assert ConfigError is Direct and issubclass(ConfigError, ValueError)
