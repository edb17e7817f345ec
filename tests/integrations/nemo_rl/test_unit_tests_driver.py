"""scripts/nemo_rl_unit_tests.py and its plug plugin, the parts that run without NeMo-RL's test run.

The driver itself (NeMo-RL's unit tests twice, unplugged and plugged) runs in .ci/run with the
environment of scripts/nemo_rl_env.sh; here: its reading of pytest's JUnit report, its verdict,
its selection against NeMo-RL's tree, and the plugin's install, count and removal on modules with
NeMo-RL's names.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.integrations.nemo_rl.pytest_plugins import nemo_replay_plug

ROOT = Path(__file__).resolve().parents[3]


@functools.lru_cache(maxsize=None)
def _driver():
    """The script as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("nemo_rl_unit_tests", ROOT / "scripts" / "nemo_rl_unit_tests.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_junit_report_reads_one_outcome_a_test_the_worst_one(tmp_path):
    junit = tmp_path / "r.xml"
    junit.write_text(textwrap.dedent("""\
        <testsuites><testsuite name="pytest">
          <testcase classname="tests.unit.a" name="test_ok"/>
          <testcase classname="tests.unit.a.TestC" name="test_ok"/>
          <testcase classname="tests.unit.a" name="test_fails"><failure message="x"/></testcase>
          <testcase classname="tests.unit.a" name="test_setup"><error message="fixture"/></testcase>
          <testcase classname="tests.unit.a" name="test_skip"><skipped message="CUDA not available"/></testcase>
          <testcase classname="tests.unit.a" name="test_teardown"/>
          <testcase classname="tests.unit.a" name="test_teardown"><error message="teardown"/></testcase>
        </testsuite></testsuites>"""))
    assert _driver().read_junit(junit) == {
        "tests.unit.a::test_ok": "passed", "tests.unit.a.TestC::test_ok": "passed",
        "tests.unit.a::test_fails": "failed", "tests.unit.a::test_setup": "error",
        "tests.unit.a::test_skip": "skipped", "tests.unit.a::test_teardown": "error",
    }


def _plug(**changes):
    report = {"wrapped": ["a", "b", "c", "d"], "calls": {"a": 3, "b": 0}, "not_restored": [],
              "package": str(ROOT / "nemo_replay")}
    return {**report, **changes}


def test_the_verdict_wants_the_same_passes_a_green_unplugged_run_and_a_plug_that_ran_and_left():
    d = _driver()
    unplugged = d.Run("unplugged", {"t::a": "passed", "t::b": "passed", "t::c": "skipped"})
    same = d.Run("plugged", dict(unplugged.outcomes), plug=_plug())
    assert d.verdict(unplugged, same) == []
    lost = d.Run("plugged", {"t::a": "passed", "t::b": "failed", "t::c": "skipped"}, plug=_plug())
    (problem,) = d.verdict(unplugged, lost)
    assert "1 tests pass unplugged only" in problem and "t::b: plugged failed, unplugged passed" in problem
    red = d.Run("unplugged", {"t::a": "passed", "t::b": "error"})
    assert any("the unplugged run is not green (1 failed or in error" in p for p in d.verdict(red, same))
    problems = d.verdict(unplugged, d.Run("plugged", dict(unplugged.outcomes)))
    assert problems == [f"the plugged run wrote no plug report: the plug did not run (log {Path()})"]
    idle = _plug(wrapped=["a"], calls={"a": 0}, not_restored=["from_batches"], package="/elsewhere/nemo_replay")
    problems = d.verdict(unplugged, d.Run("plugged", dict(unplugged.outcomes), plug=idle))
    assert [p.split(" ")[0] for p in problems] == ["install_data_path()", "no", "DataPath.remove()", "the"]
    assert "not this checkout: pip install -e" in problems[-1]


def test_the_selection_names_what_nemo_rls_tree_has(tmp_path):
    d = _driver()
    src = Path(os.environ.get("NEMO_RL_SRC") or ROOT.parent / "shared" / "nemo-rl-7ea279a")
    if not (src / "tests" / "unit").is_dir():
        pytest.skip(f"needs NeMo-RL's tree at 7ea279a: set NEMO_RL_SRC (looked in {src})")
    assert d.check_selection(src) == []
    (tmp_path / "tests/unit/data").mkdir(parents=True)
    (tmp_path / "tests/unit/data/test_data_processor.py").write_text("def test_math_hf_data_processor(): pass\n")
    problems = d.check_selection(tmp_path)
    assert f"{tmp_path}/tests/unit/algorithms/test_grpo.py does not exist" in problems
    assert ("deselected 'tests/unit/data/test_data_processor.py::test_math_data_processor': tests/unit/data/"
            "test_data_processor.py defines no test starting with 'test_math_data_processor'") in problems


def test_the_plugin_installs_the_plug_counts_its_calls_and_removes_it(tmp_path, monkeypatch):
    """On modules with NeMo-RL's names (test_datapath's stand-ins): the plug wraps four functions
    above the plugin's counters, the counters see the calls that went through it, and after the
    removal NeMo-RL's own functions are back."""
    from tests.integrations.nemo_rl.test_datapath import _multi_turn_logs, _stand_ins

    grpo, bdd, rollouts = _stand_ins(tmp_path)
    for name, module in (("nemo_rl.algorithms.grpo", grpo), ("nemo_rl.distributed.batched_data_dict", bdd),
                         ("nemo_rl.experience.rollouts", rollouts)):
        monkeypatch.setitem(sys.modules, name, module)
    own = (vars(bdd.BatchedDataDict)["from_batches"], grpo.batched_message_log_to_flat_message,
           grpo.add_grpo_token_loss_masks_and_generation_logprobs, grpo._preserve_router_replay_routed_experts)
    report = tmp_path / "plug.json"
    monkeypatch.setenv("NEMO_REPLAY_PLUG_REPORT", str(report))
    nemo_replay_plug.pytest_configure(None)
    bdd.BatchedDataDict.from_batches([{}], pad_value_dict={"output_ids": 0})
    assert bdd.calls == [{"output_ids": 0, "generation_support": -1}]  # through the plug, then the counter
    logs = _multi_turn_logs()
    grpo.add_grpo_token_loss_masks_and_generation_logprobs(logs)
    grpo.add_grpo_token_loss_masks_and_generation_logprobs(logs)
    grpo._preserve_router_replay_routed_experts({"input_ids": torch.zeros(1, 3)}, {}, {})
    nemo_replay_plug.pytest_unconfigure(None)
    got = json.loads(report.read_text())
    assert got["calls"] == {"BatchedDataDict.from_batches": 1, "batched_message_log_to_flat_message": 0,
                            "add_grpo_token_loss_masks_and_generation_logprobs": 2,
                            "_preserve_router_replay_routed_experts": 1}
    assert len(got["wrapped"]) == 4 and got["not_restored"] == []
    assert Path(got["package"]) == ROOT / "nemo_replay"
    assert (vars(bdd.BatchedDataDict)["from_batches"], grpo.batched_message_log_to_flat_message,
            grpo.add_grpo_token_loss_masks_and_generation_logprobs, grpo._preserve_router_replay_routed_experts) == own


def test_ray_sessions_get_a_short_root_whatever_tmpdir_is(tmp_path, monkeypatch):
    """RAY_TMPDIR lay under $TMPDIR/nrl-unit-*/: with a TMPDIR past about 6 characters (a job's
    scratch folder) Ray's socket paths passed AF_UNIX's 107 bytes and every test errored. Each run's
    Ray session now lies in a short root under /tmp, checked to fit, whatever TMPDIR is."""
    import subprocess
    import tempfile

    driver = _driver()
    scratch = tmp_path / ("scratch-of-a-cluster-job-" + "x" * 40)
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    work = Path(tempfile.mkdtemp(prefix="nrl-unit-"))
    assert str(work).startswith(str(scratch))
    seen = {}

    class Started:
        pid = 0

        def wait(self, timeout=None):
            return 0

    def popen(command, *, env, **kwargs):
        seen["ray"] = env["RAY_TMPDIR"]
        return Started()

    monkeypatch.setattr(subprocess, "Popen", popen)
    ray = driver.ray_root()
    try:
        for plugged in (False, True):
            with pytest.raises(SystemExit, match="wrote no report"):  # nothing ran: stopped before reading it
                driver.run_pytest(tmp_path, work, ray, plugged=plugged, timeout=1)
            assert Path(seen["ray"]).is_dir() and not seen["ray"].startswith(str(scratch))
            assert len(seen["ray"].encode()) + driver.RAY_TAIL <= driver.SOCKET_PATH_MAX == 107, seen["ray"]
    finally:
        import shutil

        shutil.rmtree(ray)
    with pytest.raises(SystemExit, match=r"would reach \d+ bytes, past AF_UNIX's 107; give ray_root\(\) a shorter"):
        driver.ray_root(str(scratch))
    assert list(scratch.glob("nrl-*")) == [work]  # the refused root is not left behind
