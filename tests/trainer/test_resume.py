"""Long runs on one process: SIGTERM mid-run and resume, bit for bit; resume modes; run folders; guards.

The run under test is the real command line (``python -m nemo_replay train``) in a
subprocess, stopped with a real SIGTERM; the reference is the same command never stopped,
run through ``nemo_replay.cli.main`` in the test's own process (it pays no second start-up).
Both use one CPU thread (``trainer.num_threads=1``) so their float reductions agree.
Rows are compared in full except ``step_time_s``, the one wall-clock metric.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_replay.trainer.config import load_config
from nemo_replay.trainer.rundir.checkpoint import latest_checkpoint
from nemo_replay.trainer.grpo import GRPOTrainer
from nemo_replay.trainer.guards import NonFiniteError
from nemo_replay.trainer.preemption import PREEMPTED_EXIT
from nemo_replay.trainer.rundir import default_run_name, new_run_dir
from tests.trainer.tiny import tiny

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _cmd(out: Path, *extra: str, steps: int) -> list[str]:
    overrides = [o for o in tiny(out, steps=steps) if not o.startswith("trainer.plot")]
    return [sys.executable, "-m", "nemo_replay", "train", *overrides, "trainer.num_threads=1", "trainer.plot=true", *extra]


def _rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("step_time_s")
    return rows


def _wait_for_rows(path: Path, proc: subprocess.Popen, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before writing {n} rows: {proc.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"no {n} rows in {path} after {timeout} s")


def _here(cmd: list[str], command: str = "train") -> int:
    """``cmd`` (a ``_cmd`` list) run by the same command line in this process, on one thread as the subprocess."""
    import torch

    from nemo_replay.cli import main

    threads = torch.get_num_threads()
    try:
        return main(cmd[cmd.index(command):])
    finally:
        torch.set_num_threads(threads)


def test_sigterm_mid_run_then_resume_matches_the_uninterrupted_run(tmp_path):
    steps = 8
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    cmd = _cmd(stopped, "trainer.checkpoint_every=3", steps=steps)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_rows(stopped / "metrics.jsonl", proc, 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == PREEMPTED_EXIT, err
    done = len(_rows(stopped))
    assert 1 <= done < steps, "the signal must land mid-run"
    # It finished the step in flight, wrote a checkpoint of exactly those steps, the plot and the summary.
    ckpt = latest_checkpoint(stopped / "checkpoints")
    assert ckpt is not None and ckpt.step == done - 1
    assert "SIGTERM received: finishing this step" in err and f"stopped by SIGTERM after {done} of {steps} steps" in err
    assert "resume with: nemo-replay train" in err and "Traceback" not in err
    assert (stopped / "metrics.png").stat().st_size > 0
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps"] == done
    # The same command again continues from there; the reference, the same command never stopped,
    # runs alongside in this process (one thread each).
    again = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _here(_cmd(straight, "trainer.checkpoint_every=3", steps=steps)) == 0
    _, again_err = again.communicate(timeout=300)
    assert again.returncode == 0, again_err
    assert f"resuming {stopped} after step {done - 1}" in again_err
    resumed, uninterrupted = _rows(stopped), _rows(straight)
    assert [r["step"] for r in resumed] == list(range(steps))
    diff = [(a["step"], {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}) for a, b in zip(resumed, uninterrupted)]
    assert resumed == uninterrupted, diff  # bit for bit: every metric of every step
    assert json.loads((stopped / "summary.json").read_text())["first_step"] == done


def test_compare_stopped_in_its_second_half_continues_with_the_same_command(tmp_path, capsys):
    steps = 4
    cmd = [*_cmd(tmp_path, "trainer.checkpoint_every=0", steps=steps), "trainer.plot=false"]
    cmd[cmd.index("train")] = "compare"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_rows(tmp_path / "replay-off" / "metrics.jsonl", proc, 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == PREEMPTED_EXIT, err
    assert "resume with: nemo-replay compare" in err and not (tmp_path / "summary.json").exists()
    done = len(_rows(tmp_path / "replay-off"))
    assert 1 <= done < steps, "the signal must land in the second half"
    on_rows = _rows(tmp_path / "replay-on")
    # The same command again (here in this process).
    capsys.readouterr()
    rc = _here(cmd, "compare")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"nemo-replay compare: resuming {tmp_path / 'replay-on'} after step {steps - 1}" in err
    assert _rows(tmp_path / "replay-on") == on_rows  # the finished half is not run again
    assert [r["step"] for r in _rows(tmp_path / "replay-off")] == list(range(steps))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replay_on"]["steps"] == summary["replay_off"]["steps"] == steps


def test_second_signal_exits_at_once_and_copies_of_one_signal_do_not_count(tmp_path):
    """The real handlers in a real process: a repeat within the window is ignored, a later one exits 128 + n."""
    script = (
        "import os, signal, time\n"
        "from nemo_replay.trainer.preemption import StopSignals, REPEAT_WINDOW_S\n"
        "s = StopSignals(); s.install()\n"
        "os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM)\n"  # Ctrl-C: no KeyboardInterrupt
        "assert s.received == signal.SIGINT and s.agreed() == 'SIGINT'\n"
        "print('still running', flush=True)\n"
        "time.sleep(REPEAT_WINDOW_S + 0.2)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(30)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1, proc.stderr
    assert proc.stdout == "still running\n"
    assert "second signal (SIGUSR1): stopping now without a checkpoint" in proc.stderr


def test_resume_modes_and_folders_that_hold_runs(tmp_path):
    out = tmp_path / "run"
    first = GRPOTrainer(load_config(overrides=tiny(out, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", steps=2)))
    history = first.fit().history
    # keep_checkpoints=1: only the newest survives.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001"]
    with pytest.raises(ValueError, match="already holds a run .*trainer.resume=never"):
        GRPOTrainer(load_config(overrides=tiny(out, "trainer.resume=never", steps=3)))
    with pytest.raises(ValueError, match=r"recipe differs in trainer.lr: 0.001 -> 0.002"):
        GRPOTrainer(load_config(overrides=tiny(out, "trainer.lr=0.002", steps=3)))
    with pytest.raises(ValueError, match="trainer.resume=must but trainer.output_dir=.* does not exist"):
        GRPOTrainer(load_config(overrides=tiny(tmp_path / "fresh", "trainer.resume=must", steps=1)))
    assert not (tmp_path / "fresh").exists()  # nothing created for a run that did not start
    (tmp_path / "fresh").mkdir()
    with pytest.raises(ValueError, match="has no complete checkpoint to continue from"):
        GRPOTrainer(load_config(overrides=tiny(tmp_path / "fresh", "trainer.resume=must", steps=1)))
    # A run without checkpoints under another recipe is never continued nor overwritten
    # (under its own recipe it starts again: tests/trainer/test_resume_heals.py).
    bare = tmp_path / "bare"
    GRPOTrainer(load_config(overrides=tiny(bare, "trainer.checkpoint_every=0", steps=1))).fit()
    before = (bare / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="without a complete checkpoint and with a recipe that differs in model.hidden_size"):
        GRPOTrainer(load_config(overrides=tiny(bare, "trainer.checkpoint_every=0", "model.hidden_size=16", steps=2)))
    assert (bare / "metrics.jsonl").read_text() == before
    # Half-written checkpoints are never resumed from: a folder without complete.json, a partial one.
    (out / "checkpoints" / "step-0000009" / "state").mkdir(parents=True)
    (out / "checkpoints" / ".partial-step-0000010-abcdef").mkdir()
    # A deletion a crash interrupted (renamed away, half removed) is finished by the next prune.
    (out / "checkpoints" / ".deleting-step-0000000-1a2b" / "state").mkdir(parents=True)
    # Rows past the checkpoint (a run killed before its next checkpoint) move aside, never lost.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "reward": 0.5}) + "\n")
    resumed = GRPOTrainer(load_config(overrides=tiny(out, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=1", steps=3)))
    assert resumed.start_step == 2 and resumed.history == history
    result = resumed.fit()
    assert [r["step"] for r in result.history] == [0, 1, 2] and result.first_step == 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    (aside,) = out.glob("metrics.after-step-1-*.jsonl")
    assert json.loads(aside.read_text()) == {"step": 2, "reward": 0.5}
    # The partial folder went; the orphan step-0000009 (no complete.json) is not a checkpoint: it is
    # moved aside, kept and named, never resumed from nor pruned.
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[1:] == ["step-0000002"] and names[0].startswith(".unloadable-step-0000009-"), names
    assert "step-0000009 has no readable complete.json (FileNotFoundError" in (out / "resume.log").read_text()


def _hold(folder: str, held) -> None:
    from nemo_replay.trainer.rundir import _lock

    Path(folder).mkdir()
    _lock(Path(folder))  # a plain descriptor: the lock stays until the process is killed
    held.set()
    time.sleep(60)


def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path):
    # Another process (forked: the package is already imported) holds the folder's lock.
    out = tmp_path / "busy"
    fork = multiprocessing.get_context("fork")
    held = fork.Event()
    holder = fork.Process(target=_hold, args=(str(out), held))
    holder.start()
    try:
        assert held.wait(timeout=60)
        with pytest.raises(ValueError, match=rf"is in use by a running run \(pid {holder.pid} on "):
            GRPOTrainer(load_config(overrides=tiny(out, steps=1)))
    finally:
        holder.kill()
        holder.join()
    GRPOTrainer(load_config(overrides=tiny(out, steps=1)))  # the kernel dropped the lock with its process


def _make_runs(runs: str, ready, go, made) -> None:
    ready.release()
    go.wait()
    made.put([str(new_run_dir(Path(runs), "20250101-000000-fsdp-replay-on")) for _ in range(8)])


def test_default_run_folders_never_collide(tmp_path, monkeypatch):
    fork = multiprocessing.get_context("fork")  # processes of their own, the package already imported
    ready, go, made_q = fork.Semaphore(0), fork.Event(), fork.Queue()
    procs = [fork.Process(target=_make_runs, args=(str(tmp_path / "runs"), ready, go, made_q)) for _ in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        assert ready.acquire(timeout=60)  # every process is up: now all at once
    go.set()
    made = [d for _ in procs for d in made_q.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(made) == len(set(made)) == 16  # two processes, eight runs each, started together
    cfg = load_config()
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    assert default_run_name(cfg).endswith("-fsdp-replay-on-j777")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "700")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert default_run_name(cfg, "-x").endswith("-fsdp-replay-on-x-j700_3")


def test_non_finite_updates_stop_the_run_naming_step_quantity_and_causes(tmp_path):
    trainer = GRPOTrainer(load_config(overrides=tiny(tmp_path / "a", "trainer.lr=1e6", steps=3)))
    with pytest.raises(NonFiniteError) as info:
        trainer.fit()
    message = str(info.value)
    assert message.startswith("step 1, minibatch 0: ") and "is nan before the optimizer step" in message
    assert "the update was not applied" in message and "trainer.lr=1e+06 too large" in message
    # The refused update left the weights finite; the broken step logged no row.
    assert all(bool(p.isfinite().all()) for p in trainer.policy.parameters())
    assert [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [0]
    # Finite gradients can still throw the weights far: the next rollout's non-finite logits name the cause.
    trainer = GRPOTrainer(load_config(overrides=tiny(tmp_path / "b", "trainer.lr=1e12", steps=3)))
    with pytest.raises(NonFiniteError, match=r"^step 1: sampling met non-finite logits .* trainer.lr=1e\+12 too large"):
        trainer.fit()


def test_a_failed_run_frees_its_folder_for_the_next_run_in_the_same_process(tmp_path):
    out = tmp_path / "run"
    recipe = tiny(out, "trainer.lr=1e6", "trainer.checkpoint_every=1", steps=3)

    class Broken:
        def build_models(self):
            raise RuntimeError("no models today")

    with pytest.raises(RuntimeError, match="no models today"):  # fails after the folder was taken
        GRPOTrainer(load_config(overrides=recipe), backend=Broken())
    trainer = GRPOTrainer(load_config(overrides=recipe))
    with pytest.raises(NonFiniteError, match="^step 1, minibatch 0: "):
        trainer.fit()
    # Same process, same command: it resumes after the last good step instead of finding the folder in use.
    again = GRPOTrainer(load_config(overrides=recipe))
    assert again.start_step == 1 and [r["step"] for r in again.history] == [0]
    again.run_dir.release()


def test_only_a_non_finite_sampling_error_is_reported_as_divergence():
    import torch

    from nemo_replay.trainer.guards import diverged_rollout

    cfg, model = load_config(), torch.nn.Linear(2, 2)
    # An unrelated error whose words merely contain "inf" / "nan" passes through unchanged.
    for text in ("prompt 3 is longer than the inference context; see the information above", "finance task unknown"):
        assert diverged_rollout(cfg, ValueError(text), step=4, model=model) is None
    err = diverged_rollout(cfg, ValueError("capture.sample: logits row 2 holds NaN or +inf, or no finite value"), step=4, model=model)
    assert isinstance(err, NonFiniteError) and str(err).startswith("step 4: sampling met non-finite logits (capture.sample:")


def test_check_update_reads_tensor_losses_and_names_the_bad_quantity():
    import torch

    from nemo_replay.trainer.guards import check_update

    cfg = load_config()
    check_update(cfg, step=0, minibatch=0, losses=[torch.tensor(0.5), torch.tensor(-2.0)], grad_norm=1.0)  # finite: passes
    check_update(cfg, step=0, minibatch=0, losses=[], grad_norm=1.0)
    with pytest.raises(NonFiniteError, match=r"^step 3, minibatch 1: the policy loss is nan before the optimizer step"):
        check_update(cfg, step=3, minibatch=1, losses=[torch.tensor(0.5), torch.tensor(float("nan"))], grad_norm=1.0)
    with pytest.raises(NonFiniteError, match=r"^step 3, minibatch 0: the policy loss is inf and the gradient norm is inf "):
        check_update(cfg, step=3, minibatch=0, losses=[torch.tensor(float("inf"))], grad_norm=float("inf"))
