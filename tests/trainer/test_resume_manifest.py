"""Manifests that cannot steer a resume: a ``complete.json`` whose step, files, version or format
cannot be trusted sets its checkpoint aside (named in resume.log) and the one before resumes.

Fast cases edit the manifest of a checkpoint written by :class:`Checkpointer` for a small
model; the end-to-end ones run the reference trainer on the tiny recipe, as
``test_resume_heals.py`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.grpo import GRPOTrainer
from nemo_replay.trainer.rundir import checkpoint as ck
from tests.trainer.tiny import tiny

KEEP = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=3")


def _trainer(out, *extra, steps) -> GRPOTrainer:
    return GRPOTrainer(load_config(overrides=tiny(out, *extra, steps=steps)))


def _edit(folder: Path, **fields) -> None:
    """Rewrite ``folder``'s complete.json with ``fields`` changed (a value of ``...`` drops the key)."""
    manifest = json.loads((folder / "complete.json").read_text())
    for key, value in fields.items():
        manifest.pop(key) if value is ... else manifest.__setitem__(key, value)
    (folder / "complete.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two checkpoints (steps 0 and 1) of a small model, written once; each test gets a copy."""
    from lightning.fabric import Fabric

    root = tmp_path_factory.mktemp("written") / "checkpoints"
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    store = ck.Checkpointer(root, Fabric(accelerator="cpu", devices=1), every=1, keep=0, config="x: 1\n")
    for step in (0, 1):
        store.save(step, model, optimizer, history=[], rank_state={})
    return root


@pytest.fixture
def root(written, tmp_path):
    import shutil

    return Path(shutil.copytree(written, tmp_path / "checkpoints"))


def _store(root: Path) -> ck.Checkpointer:
    from lightning.fabric import Fabric

    return ck.Checkpointer(root, Fabric(accelerator="cpu", devices=1), every=1, keep=0, config="x: 1\n")


def _model():
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_new_manifest_carries_its_version_and_loads(root):
    newest = root / "step-0000001"
    assert json.loads((newest / "complete.json").read_text())["version"] == 2
    info = ck.latest_checkpoint(root)
    assert info.path == newest and info.step == 1 and ck.unreadable_manifests(root) == []
    _store(root).load(info, *_model())


STATE_HASH = "0" * 64


@pytest.mark.parametrize("fields, why", [
    ({"step": float("inf")}, "its step is Infinity where the folder's number 1 is expected"),
    ({"step": float("nan")}, "its step is NaN where"),
    ({"step": 0}, "its step is 0 where the folder's number 1 is expected"),
    ({"step": 2}, "its step is 2 where"),
    ({"step": 1.0}, "its step is 1.0 where"),
    ({"step": 2.9}, "its step is 2.9 where"),
    ({"step": "1"}, 'its step is "1" where'),
    ({"step": True}, "its step is true where"),
    ({"step": ...}, "its step is null where"),
    ({"world_size": float("inf")}, "its world_size is Infinity where a process count >= 1 is expected"),
    ({"world_size": 0}, "its world_size is 0 where"),
    ({"format": "xyz"}, 'its format is "xyz" where one of fabric, megatron-dist is expected'),
    ({"config": None}, "its config is not the recipe's YAML text"),
    ({"version": 3}, "its version is 3, this nemo_replay reads versions 1 to 2"),
    ({"version": "2"}, 'its version is "2"'),
    ({"files": {}}, "its files entry is {} where {name: [size, sha256]} of every file is expected"),
    ({"files": None}, "its files entry is null where"),
    ({"files": ...}, "its files entry is null where"),
    ({"files": ..., "version": ...}, "a checkpoint written before digests"),
    ({"files": []}, "its files entry is [] where"),
    ({"files": {"../../x": [4, STATE_HASH]}}, "'../../x' is not a relative path inside the checkpoint's folder"),
    ({"files": {"/etc/hostname": [4, STATE_HASH]}}, "'/etc/hostname' is not a relative path inside"),
    ({"files": {"state/../state": [4, STATE_HASH]}}, "'state/../state' is not a relative path inside"),
    ({"files": {"./state": [4, STATE_HASH]}}, "'./state' is not a relative path"),
    ({"files": {"state": [float("inf"), STATE_HASH]}}, "its files entry for 'state' is [Infinity, "),
    ({"files": {"state": [-1, STATE_HASH]}}, "its files entry for 'state' is [-1, "),
    ({"files": {"state": [4, "zz"]}}, "where [size, 64 hex digits of SHA-256] is expected"),
])
def test_a_manifest_that_cannot_be_trusted_is_named_and_never_resumed_from(root, fields, why):
    _edit(root / "step-0000001", **fields)
    ((path, reason),) = ck.unreadable_manifests(root)
    assert path == root / "step-0000001" and reason.startswith("ManifestUntrusted: ") and why in reason, reason
    assert ck.latest_checkpoint(root).path == root / "step-0000000"  # the one before


@pytest.mark.parametrize("text", ["[1, 2]", '"step"', "1" * 5000, "[" * 100_000])
def test_a_manifest_of_another_shape_is_named_not_raised(root, text):
    (root / "step-0000001" / "complete.json").write_text(text)
    ((path, reason),) = ck.unreadable_manifests(root)
    assert path.name == "step-0000001" and reason, reason
    assert ck.latest_checkpoint(root).step == 0


def test_a_folder_named_like_a_checkpoint_but_not_step_n_is_never_read_as_one(root):
    import shutil

    shutil.copytree(root / "step-0000001", root / "step-1x")  # the glob step-* the space check reads matches it
    assert ck._read_manifest(root / "step-1x") is None
    assert ck.latest_checkpoint(root).path.name == "step-0000001"


def test_a_previous_format_manifest_without_a_version_still_loads_under_the_same_checks(root):
    _edit(root / "step-0000001", version=...)
    info = ck.latest_checkpoint(root)
    assert info.step == 1 and ck.unreadable_manifests(root) == []
    _store(root).load(info, *_model())


def _unreadable(root: Path, info) -> str:
    with pytest.raises(ck.CheckpointUnreadable) as err:
        _store(root).load(info, *_model())
    return err.value.cause


def test_a_file_of_the_folder_that_the_manifest_does_not_list_is_refused(root):
    newest = root / "step-0000001"
    (newest / "extra.pt").write_bytes(b"not written by the checkpoint")
    cause = _unreadable(root, ck.latest_checkpoint(root))
    assert cause == "extra.pt is not listed in complete.json (a file the checkpoint was not written with)"


def test_a_listed_file_reached_through_a_link_out_of_the_folder_is_refused(root, tmp_path):
    newest = root / "step-0000001"
    outside = tmp_path / "outside-state"
    os.replace(newest / "state", outside)  # the same bytes: its digest is right
    (newest / "state").symlink_to(outside)
    cause = _unreadable(root, ck.latest_checkpoint(root))
    assert cause.startswith("state leads out of the checkpoint's folder (a link)"), cause


def test_a_state_holding_another_step_than_its_folder_is_refused(root):
    moved = root / "step-0000007"
    os.rename(root / "step-0000001", moved)  # folder and manifest agree on 7; the state holds 1
    _edit(moved, step=7)
    info = ck.latest_checkpoint(root)
    assert info.step == 7
    assert _unreadable(root, info) == "its state holds step 1 where its folder and complete.json say 7"


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _aside(ckpts: Path) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[0] for p in ckpts.glob(".unloadable-*"))


def test_an_infinite_or_edited_step_sets_the_checkpoint_aside_and_the_run_goes_on_once(tmp_path):
    """``"step": Infinity`` killed every resume with OverflowError (a requeued job looped); an edit
    from 1 to 0 retrained step 1. Both are set aside, named, and the run resumes from step 0."""
    out = tmp_path / "run"
    _trainer(out, *KEEP, steps=3).fit()
    ckpts = out / "checkpoints"
    _edit(ckpts / "step-0000002", step=float("inf"))
    _edit(ckpts / "step-0000001", step=0)
    trainer = _trainer(out, *KEEP, steps=4)
    assert trainer.start_step == 1 and trainer.run_dir.resume.step == 0
    assert _aside(ckpts) == [".unloadable-step-0000001", ".unloadable-step-0000002"]
    log = (out / "resume.log").read_text()
    assert "step-0000002 has no readable complete.json (ManifestUntrusted: its step is Infinity" in log, log
    assert "step-0000001 has no readable complete.json (ManifestUntrusted: its step is 0 where" in log, log
    trainer.fit()
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3]  # no step trained twice
    again = _trainer(out, *KEEP, steps=4)  # the next start finds the run done: no loop
    assert again.start_step == 4
    again.run_dir.release()


def test_an_outside_file_or_an_empty_listing_never_lets_a_flipped_state_load(tmp_path):
    """``"files": {}`` read as a pre-digest checkpoint loaded a flipped state unchecked; a listing
    naming ``../../x`` hashed a file outside the run. Both are set aside; the flip never trains."""
    from tests.trainer.distributed_runs import rows

    out = tmp_path / "run"
    straight = _trainer(tmp_path / "straight", *KEEP, steps=3).fit().history
    _trainer(out, *KEEP, steps=3).fit()
    ckpts = out / "checkpoints"
    state = ckpts / "step-0000002" / "state"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    _edit(ckpts / "step-0000002", files={})
    outside = tmp_path / "x"
    outside.write_bytes(b"outside the run")
    listing = json.loads((ckpts / "step-0000001" / "complete.json").read_text())["files"]
    _edit(ckpts / "step-0000001", files=dict(listing, **{"../../../x": [15, "0" * 64]}))
    trainer = _trainer(out, *KEEP, steps=3)
    assert trainer.start_step == 1
    log = (out / "resume.log").read_text()
    assert "its files entry is {} where" in log and "'../../../x' is not a relative path inside" in log, log
    assert str(outside) not in log and "SHA-256" not in log  # nothing outside the folder was read
    assert rows(trainer.fit().history) == rows(straight)
