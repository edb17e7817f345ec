"""NeMo-RL's own unit tests pass with replay's driver plug installed exactly as they pass without it.

    bash scripts/nemo_rl_env.sh
    "$NEMO_RL_ENV/bin/python" scripts/nemo_rl_unit_tests.py [NEMO_RL_SRC]

Run with the Python of scripts/nemo_rl_env.sh (its pytest runs the tests). NEMO_RL_SRC: NeMo-RL's
tree at 7ea279a (default: $NEMO_RL_SRC, else ../shared/nemo-rl-7ea279a); it is never modified.

1. ``copy_and_patch``: the tree is copied to a temp folder and the package's patch applied to
   the copy (``python -m nemo_replay.integrations.nemo_rl.patch apply DIR``).
2. ``run_pytest``, twice, in the copy: unplugged, then with ``install_data_path()`` active for
   the whole test process (tests/integrations/nemo_rl/pytest_plugins/nemo_replay_plug.py, as the
   launcher installs it in NeMo-RL's driver). Both load nemo_rl_cpu_shims.py (Python 3.11, CPU
   torch). NeMo-RL's conftest starts a local Ray cluster; each run gets its own (RAY_TMPDIR in a
   short folder under /tmp, :func:`ray_root`, so its sockets fit AF_UNIX's 107 bytes whatever
   $TMPDIR is; RAY_ADDRESS dropped), and the ambient PYTHONPATH is dropped (NeMo-RL's tests are a
   ``tests`` package, as this repository's are).
3. ``verdict``: exit 1 unless both runs pass the same test ids, the unplugged run fails none, the
   plug wrapped its four functions, the tests went through them, and ``DataPath.remove()`` put
   them back; the counts and any difference are printed.

Selection (issue 37 item 7): :data:`FILES`, with NeMo-RL's own conftest defaults (it leaves out
the tests marked hf_gated, mcore, automodel, vllm, sglang, trtllm and nemo_gym), less
:data:`DOWNLOADS`: tests that load a tokenizer or a data set from the Hugging Face Hub, each named
with what it loads. The runs are offline (HF_HUB_OFFLINE=1), so a test that starts to need a
download fails at once naming it, instead of waiting on the network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "integrations" / "nemo_rl" / "pytest_plugins"

#: NeMo-RL's unit tests that must stay green with the plug installed (paths in its tree).
FILES = (
    "tests/unit/algorithms/test_grpo.py",
    "tests/unit/algorithms/test_grpo_router_replay_async.py",
    "tests/unit/experience",
    "tests/unit/distributed/test_batched_data_dict.py",
    "tests/unit/data",
)

_DATA = "tests/unit/data/"
_AVQA = _DATA + "datasets/test_avqa_dataset.py::TestAVQADataset::"
_RESPONSE = _DATA + "datasets/test_response_dataset.py::"
_MESSAGES = _DATA + "test_llm_message_utils.py::"
#: pytest ``--deselect`` node-id prefixes -> what each loads from the Hugging Face Hub.
DOWNLOADS = {
    **{_AVQA + name: "data set gijs/avqa-processed" for name in (
        "test_avqa_dataset_loads", "test_avqa_dataset_with_split_validation", "test_avqa_dataset_format_data",
        "test_avqa_dataset_has_task_name_column", "test_avqa_load_via_registry")},
    _DATA + "datasets/test_oai_format_dataset.py::test_message_formatting": "tokenizer Qwen/Qwen3-0.6B",
    _DATA + "datasets/test_preference_dataset.py::test_build_in_dataset":
        "data sets nvidia/HelpSteer3, allenai/llama-3.1-tulu-3-8b-preference-mixture",
    _RESPONSE + "test_response_dataset[": "tokenizer Qwen/Qwen3-0.6B",
    _RESPONSE + "test_response_dataset_gsm8k_with_subset": "data set openai/gsm8k",
    _RESPONSE + "test_helpsteer3_dataset": "data set nvidia/HelpSteer3",
    _RESPONSE + "test_open_assistant_dataset": "data set OpenAssistant/oasst1",
    # the prefix holds test_build_in_dataset_with_split_validation too
    _RESPONSE + "test_build_in_dataset": "tokenizer Qwen/Qwen3-0.6B and each built-in data set",
    _RESPONSE + "test_vlm_dataset": "data sets MMInstruction/Clevr_CoGenT_TrainA_70K_Complex, hiyouga/geometry3k",
    _RESPONSE + "test_dailyomni_dataset": "data set liarliar/Daily-Omni",
    _DATA + "test_data_processor.py::test_math_data_processor": "tokenizer Qwen/Qwen2.5-Math-1.5B-Instruct",
    _DATA + "test_data_shuffle_reproducity.py":
        "tokenizer Qwen/Qwen2.5-Math-1.5B-Instruct, data set nvidia/OpenMathInstruct-2",
    # its llama and gemma cases are hf_gated (left out by NeMo-RL's conftest)
    _MESSAGES + "test_get_formatted_message_log_models": "tokenizer Qwen/Qwen2.5-Coder-32B-Instruct",
    _MESSAGES + "test_get_formatted_message_log_qwen3_enable_thinking": "tokenizer Qwen/Qwen3-8B",
    _MESSAGES + "test_get_formatted_message_log_debug_": "tokenizer Qwen/Qwen2.5-0.5B-Instruct",
}

#: What the plug wraps (datapath.install_data_path).
PLUG_WRAPS = 4
#: The longest AF_UNIX socket path on Linux (``sun_path`` holds 108 bytes with its NUL); Ray
#: refuses a session whose sockets would pass it (``validate_socket_filename failed``).
SOCKET_PATH_MAX = 107
#: Bytes Ray appends to RAY_TMPDIR for its session folder and socket names: measured 62 with the
#: NeMo-RL environment's Ray 2.60.0 (``session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store``,
#: a 5-digit process id), plus room for a 7-digit process id and a longer socket name.
RAY_TAIL = 72


def check_selection(tree: Path) -> list[str]:
    """Problems with :data:`FILES` and :data:`DOWNLOADS` against ``tree``: a path that is not there,
    or a deselected test name its file does not define (a prefix that matches nothing deselects nothing)."""
    problems = [f"{tree}/{path} does not exist" for path in FILES if not (tree / path).exists()]
    for prefix in DOWNLOADS:
        path, _, names = prefix.partition("::")
        name = names.split("::")[-1].rstrip("[")
        if not (tree / path).is_file():
            problems.append(f"deselected {prefix!r}: {tree}/{path} does not exist")
        elif name and f"def {name}" not in (tree / path).read_text(encoding="utf-8"):
            problems.append(f"deselected {prefix!r}: {path} defines no test starting with {name!r}")
    return problems


def copy_and_patch(src: Path, dest: Path) -> None:
    """``src`` copied to ``dest`` (writable: CI's tree is read-only) and patched with the package's command."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    for root, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)
    done = subprocess.run([sys.executable, "-m", "nemo_replay.integrations.nemo_rl.patch", "apply", str(dest)],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"error: patching the copy failed: {done.stderr.strip()}")


@dataclass
class Run:
    """One pytest run: its outcome per test id (``passed``, ``failed``, ``error``, ``skipped``)."""

    name: str
    outcomes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int = 0
    log: Path = Path()
    plug: dict | None = None

    def ids(self, outcome: str) -> set[str]:
        return {test for test, got in self.outcomes.items() if got == outcome}

    def counts(self) -> str:
        return ", ".join(f"{len(self.ids(o))} {o}" for o in ("passed", "failed", "error", "skipped"))


def read_junit(path: Path) -> dict[str, str]:
    """Test id (``module.Class::name``) -> outcome; a failure or error anywhere (setup, call,
    teardown) outranks a pass or skip of the same test."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        got = "passed"
        for tag, outcome in (("skipped", "skipped"), ("failure", "failed"), ("error", "error")):
            if case.find(tag) is not None and rank[outcome] > rank[got]:
                got = outcome
        if rank[got] >= rank.get(outcomes.get(test, "passed"), 0):
            outcomes[test] = got
    return outcomes


def ray_root(parent: str = "/tmp") -> Path:
    """A short folder of its own under ``parent`` for the runs' Ray sessions (their RAY_TMPDIR).

    Ray's socket paths start with RAY_TMPDIR: under the work folder in $TMPDIR (a cluster job's
    scratch folder, ``/tmp/ci``) they passed AF_UNIX's 107 bytes and every test errored. Checked
    here to fit, with :data:`RAY_TAIL` bytes for Ray's own names, before anything starts.
    """
    root = Path(tempfile.mkdtemp(prefix="nrl-", dir=parent))
    longest = max(len(str(root / name).encode()) for name in ("unplugged", "plugged")) + RAY_TAIL
    if longest > SOCKET_PATH_MAX:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"error: Ray's socket paths under {root} would reach {longest} bytes, past AF_UNIX's "
                         f"{SOCKET_PATH_MAX}; give ray_root() a shorter parent folder than {parent}")
    return root


def run_pytest(tree: Path, work: Path, ray: Path, *, plugged: bool, timeout: float) -> Run:
    """NeMo-RL's selected unit tests in ``tree`` with this Python's pytest; ``plugged``: with the plug.

    ``work`` holds the logs and reports; ``ray`` (:func:`ray_root`) the Ray session of each run.
    """
    run = Run("plugged" if plugged else "unplugged", log=work / f"{'plugged' if plugged else 'unplugged'}.log")
    junit, report = work / f"{run.name}.xml", work / f"{run.name}.plug.json"
    plugins = ["-p", "nemo_rl_cpu_shims"] + (["-p", "nemo_replay_plug"] if plugged else [])
    # --basetemp: pytest prunes the temp folders of its other sessions under the same user otherwise.
    command = [sys.executable, "-m", "pytest", *FILES, *plugins, "-p", "no:cacheprovider", "-o", "addopts=",
               "-q", "-rfEs", f"--junitxml={junit}", f"--basetemp={work / f'tmp-{run.name}'}",
               *(f"--deselect={prefix}" for prefix in DOWNLOADS)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    (ray / run.name).mkdir()
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(PLUGINS)]), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", RAY_TMPDIR=str(ray / run.name), RAY_USAGE_STATS_ENABLED="0",
               NEMO_REPLAY_PLUG_REPORT=str(report))
    start = time.monotonic()
    with open(run.log, "w", encoding="utf-8") as log:
        # Its own session: on a timeout the whole group goes (pytest, the Ray cluster it started).
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"error: the {run.name} run took over {timeout:.0f} s (log: {run.log})")
    run.seconds = time.monotonic() - start
    if not junit.is_file():
        raise SystemExit(f"error: the {run.name} run wrote no report (exit {run.returncode}); its log: {run.log}")
    run.outcomes = read_junit(junit)
    if report.is_file():
        run.plug = json.loads(report.read_text(encoding="utf-8"))
    return run


def verdict(unplugged: Run, plugged: Run) -> list[str]:
    """What is wrong (empty: the plug leaves NeMo-RL's unit tests as they are)."""
    problems = []
    broken = sorted(unplugged.ids("failed") | unplugged.ids("error"))
    if broken:
        problems.append(f"the unplugged run is not green ({len(broken)} failed or in error; log {unplugged.log}):"
                        + "".join(f"\n    {test}" for test in broken))
    if not unplugged.ids("passed"):
        problems.append(f"the unplugged run passed no test (log {unplugged.log})")
    lost, gained = unplugged.ids("passed") - plugged.ids("passed"), plugged.ids("passed") - unplugged.ids("passed")
    for what, tests in (("pass unplugged only", lost), ("pass plugged only", gained)):
        if tests:
            problems.append(f"{len(tests)} tests {what} (log {plugged.log}):"
                            + "".join(f"\n    {test}: plugged {plugged.outcomes.get(test, 'not run')}, unplugged "
                                      f"{unplugged.outcomes.get(test, 'not run')}" for test in sorted(tests)))
    plug = plugged.plug
    if plug is None:
        problems.append(f"the plugged run wrote no plug report: the plug did not run (log {plugged.log})")
        return problems
    if len(plug["wrapped"]) != PLUG_WRAPS:
        problems.append(f"install_data_path() wrapped {plug['wrapped']}, not {PLUG_WRAPS} functions")
    if not any(plug["calls"].values()):
        problems.append("no test went through the plug: the selection does not exercise it")
    if plug["not_restored"]:
        problems.append(f"DataPath.remove() left {plug['not_restored']} wrapped")
    if Path(plug["package"]).resolve() != (REPO / "nemo_replay").resolve():
        problems.append(f"the plug came from {plug['package']}, not this checkout: pip install -e {REPO}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/nemo_rl_unit_tests.py", description=__doc__.splitlines()[0])
    default = os.environ.get("NEMO_RL_SRC") or str(REPO.parent / "shared" / "nemo-rl-7ea279a")
    parser.add_argument("nemo_rl_src", nargs="?", default=default,
                        help=f"NeMo-RL's tree at 7ea279a (default {default})")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default 1800)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (copy, logs, reports) on success")
    args = parser.parse_args(argv)
    src = Path(args.nemo_rl_src).resolve()
    problems = check_selection(src)
    if problems:
        print("error: the selection does not fit the tree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    work, ray = Path(tempfile.mkdtemp(prefix="nrl-unit-")), ray_root()
    tree = work / "nemo-rl"
    start = time.monotonic()
    copy_and_patch(src, tree)
    print(f"NeMo-RL's unit tests: {src} patched in {tree}; {len(FILES)} paths, {len(DOWNLOADS)} node-id prefixes "
          f"deselected (they load from the Hugging Face Hub)", flush=True)
    runs = []
    for plugged in (False, True):
        runs.append(run_pytest(tree, work, ray, plugged=plugged, timeout=args.timeout))
        print(f"  {runs[-1].name:>9}: {runs[-1].counts()} ({runs[-1].seconds:.0f} s)", flush=True)
    unplugged, plugged = runs
    if plugged.plug:
        print("  plug: " + ", ".join(f"{name} {n} calls" for name, n in plugged.plug["calls"].items())
              + ("; removed, NeMo-RL's functions restored" if not plugged.plug["not_restored"] else ""))
    problems = verdict(unplugged, plugged)
    print(f"  wall time {time.monotonic() - start:.0f} s")
    if problems:
        print("FAIL: " + "\n".join(problems) + f"\n(kept {work} and Ray's sessions in {ray})", file=sys.stderr)
        return 1
    print(f"ok: the same {len(plugged.ids('passed'))} tests pass plugged and unplugged")
    if args.keep:
        print(f"kept {work} and Ray's sessions in {ray}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
