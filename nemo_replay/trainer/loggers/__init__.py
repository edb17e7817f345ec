"""The run's experiment loggers (``trainer.loggers``): Lightning Fabric loggers under the run folder.

- ``jsonl``: :class:`~nemo_replay.trainer.loggers.jsonl.JsonlLogger`, ``metrics.jsonl``;
- ``csv``: ``lightning.fabric.loggers.CSVLogger``, ``csv/metrics.csv``;
- ``tensorboard``: ``lightning.fabric.loggers.TensorBoardLogger``, ``tensorboard/events.out.tfevents.*``;
- ``wandb``: ``lightning.pytorch.loggers.WandbLogger``, offline, ``wandb/offline-run-<time>-<id>/``;
- ``mlflow``: ``lightning.pytorch.loggers.MLFlowLogger``, the file store ``mlruns/`` (tracking
  URI ``file:<run>/mlruns``).

Fabric 2.6 ships the first three; for W&B and MLflow the loggers are Lightning's own
(subclasses of Fabric's ``Logger``, driven through the same ``log_metrics`` /
``log_hyperparams`` / ``finalize`` calls). ``jsonl`` is always listed: resume, the plots and
the summary read ``metrics.jsonl`` (docs/design.md §10). tensorboard, wandb and mlflow need
their extras (``pip install "nemo_replay[tensorboard]"``, ``[wandb]``, ``[mlflow]``); a
missing one is a configuration error before the run starts (:func:`logger_problems`).

What each gets. The JSONL row is the record: every field, non-finite values as ``null``. The
other loggers get the row's numeric fields (tensors read as numbers) at the row's step,
non-finite ones as the float each store keeps (csv ``nan``/``inf``, TensorBoard's float, W&B's
``NaN``/``Infinity``, MLflow's ``nan``/``inf``); a field that is not a number is not sent to
them (the trainer's rows hold numbers only). W&B and MLflow also get the recipe as the run's
config / params when their run is created. Only global rank 0 logs. Every row is on disk
when its step ends: csv writes each row, TensorBoard flushes each step.

Resume (:meth:`RunLoggers.start`). A resumed run continues the same run in every logger:
``metrics.jsonl`` and ``csv/metrics.csv`` are rewritten to the checkpoint's rows, rows of
later steps (a run killed before its next checkpoint) moved to ``*.after-step-<n>-<time>.*``
beside them; TensorBoard gets a new event file in the same folder whose writer starts at the
resumed step (``purge_step``), so TensorBoard's reader drops the older events of that step and
later ones; W&B resumes the run id kept in ``loggers.json`` (``resume="allow"``), each process
writing its own offline folder, which ``wandb sync`` uploads into that run; MLflow reopens the
run id kept in ``loggers.json``. W&B and MLflow keep what a stopped process logged past the
checkpoint (neither offers a delete): those steps are logged again, and the run's log says so.
A run started again from step 0 (killed before its first checkpoint) opens new W&B and MLflow
runs. A logger new to the run folder on resume writes the checkpoint's rows first.
"""

from __future__ import annotations

import csv
import difflib
import importlib.util
import io
import json
import numbers
import os
import secrets
import string
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["LoggerSpec", "LOGGERS", "RunLoggers", "logger_problems", "numeric_fields", "restore_csv", "IDS_FILE"]

IDS_FILE = "loggers.json"  # the W&B and MLflow run ids of the run folder, for resume


@dataclass(frozen=True)
class LoggerSpec:
    """One value of ``trainer.loggers``.

    Attributes:
        name: the value.
        writes: what it writes, under the run folder.
        modules: importable modules it needs; any one is enough (none: always available).
        extra: the ``nemo_replay`` extra that installs them.
        make: the class that builds and drives it (a :class:`_RunLogger`).
    """

    name: str
    writes: str
    modules: tuple[str, ...]
    extra: Optional[str]
    make: type

    def missing(self) -> Optional[str]:
        """Why this logger cannot run here (its package is not installed), else None."""
        if not self.modules or any(importlib.util.find_spec(m) is not None for m in self.modules):
            return None
        needs = " or ".join(self.modules)
        return (f"trainer.loggers: {self.name} needs the {needs} package, which is not installed; "
                f'pip install "nemo_replay[{self.extra}]", or remove {self.name} from trainer.loggers')


def numeric_fields(metrics: dict) -> dict[str, Any]:
    """The fields of a metrics row that are numbers (0-d tensors read as numbers; bools as 0 / 1)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, numbers.Real):
            out[key] = value
    return out


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _span(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"


# ---------------------------------------------------------------------------------------- loggers
class _RunLogger:
    """One logger of a run: its Fabric logger and how it starts, logs and ends.

    ``start(mode, rows, ids, hparams, later)``: ``mode`` is ``new`` (a fresh run), ``restart``
    (a folder killed before its first checkpoint, starting again at step 0) or ``resume``
    (``rows``: the checkpoint's rows; ``later``: the steps a stopped process logged past it);
    ``ids``: the run ids kept in ``loggers.json``, updated in place; ``hparams``: the recipe.
    Returns a line for the run's log, or None.
    """

    def __init__(self, run: Path):
        self.run = run
        self.logger = None

    def start(self, mode: str, rows: Sequence[dict], ids: dict, hparams: dict, later: Sequence[int]) -> Optional[str]:
        raise NotImplementedError

    def log(self, metrics: dict, step: int) -> None:
        self.logger.log_metrics(numeric_fields(metrics), step=step)

    def backfill(self, rows: Sequence[dict]) -> None:
        """Log ``rows`` (the checkpoint's, ``step`` in each) as the trainer logged them."""
        for r in rows:
            self.log({k: v for k, v in r.items() if k != "step"}, r["step"])

    def close(self, status: str) -> None:
        if self.logger is not None:
            self.logger.finalize(status)


class _Jsonl(_RunLogger):
    side: Optional[Path] = None

    def start(self, mode, rows, ids, hparams, later):
        from nemo_replay.trainer.loggers.jsonl import JsonlLogger
        from nemo_replay.trainer.loggers.metrics import restore_rows

        self.logger = JsonlLogger(self.run)
        if mode != "new":
            self.side = restore_rows(self.logger.path, rows)
        return None  # the trainer names the side file (it also says why the rows moved)

    def log(self, metrics, step):
        self.logger.log_metrics(metrics, step=step)  # every field: the run's record

    def close(self, status):
        pass


def _csv_rows(rows: Sequence[dict]) -> tuple[list[str], list[dict]]:
    """(header, rows) as Fabric's CSV writer lays them out: numeric fields plus ``step``, keys sorted."""
    out = [{**numeric_fields({k: v for k, v in r.items() if k != "step"}), "step": r["step"]} for r in rows]
    return (sorted(set().union(*out)) if out else []), out


def restore_csv(path: Path, rows: Sequence[dict]) -> tuple[str, Optional[Path]]:
    """The text that makes ``path`` (a Fabric CSV logger's ``metrics.csv``) hold exactly ``rows``.

    Lines already in ``path`` past the last of ``rows`` (a later step, or a line that does not
    parse: the last row of a killed process) are first written to a side file beside it, with
    the header, whose path is returned (None when there were none). ``path`` itself is left
    for the caller to replace.
    """
    from nemo_replay.trainer.loggers.metrics import write_atomic

    last = rows[-1]["step"] if rows else -1
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    side = None
    if lines:
        header = next(csv.reader([lines[0]]))
        col = header.index("step") if "step" in header else None

        def past(line: str) -> bool:
            cells = next(csv.reader([line]), [])
            if col is None or len(cells) != len(header):
                return True
            try:
                return int(cells[col]) > last
            except ValueError:
                return True

        extra = [line for line in lines[1:] if line.strip() and past(line)]
        if extra:
            if not extra[-1].endswith("\n"):
                extra[-1] += "\n"
            side = path.with_name(f"{path.stem}.after-step-{last}-{_stamp()}{path.suffix}")
            write_atomic(side, lines[0] + "".join(extra))
    header, out = _csv_rows(rows)
    if not out:
        return "", side
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(out)
    return buf.getvalue(), side


class _Csv(_RunLogger):
    def start(self, mode, rows, ids, hparams, later):
        from lightning.fabric.loggers import CSVLogger

        from nemo_replay.trainer.loggers.metrics import write_atomic

        # Every row is written as it comes (flush every step): a killed process loses none.
        self.logger = CSVLogger(self.run, name="", version="csv", flush_logs_every_n_steps=1)
        if mode == "new":
            return None
        path = Path(self.logger.log_dir) / "metrics.csv"
        # Fabric's writer deletes a metrics.csv it finds when it opens: the file is held aside (one
        # rename) while it opens, then replaced by the checkpoint's rows. A crash in between leaves
        # the held file, which the next start takes back (over an empty file the writer may have
        # started, never over rows).
        held = path.with_name(f".{path.name}.held")
        if held.exists() and (not path.exists() or path.stat().st_size == 0):
            os.replace(held, path)
        text, side = restore_csv(path, rows)  # the lines past the checkpoint are in ``side`` first
        if path.exists():
            os.replace(path, held)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
            writer = self.logger.experiment
        if text:
            write_atomic(path, text)
        held.unlink(missing_ok=True)
        # The header the writer appends under; a new field makes it rewrite the file with a wider one.
        writer.metrics_keys = _csv_rows(rows)[0]
        last = rows[-1]["step"] if rows else -1
        return f"csv: rows of steps after {last} moved to {side}" if side else None


class _TensorBoard(_RunLogger):
    def start(self, mode, rows, ids, hparams, later):
        from lightning.fabric.loggers import TensorBoardLogger

        folder = self.run / "tensorboard"
        earlier = folder.is_dir() and any(folder.glob("events.out.tfevents.*"))
        first = rows[-1]["step"] + 1 if rows else 0
        # purge_step: this writer opens with a restart marker at the resumed step; TensorBoard's
        # reader then drops the events of that step and later ones from the event files before it
        # (written by a stopped process past its checkpoint, or by a run started again).
        kwargs = {"purge_step": first} if mode != "new" and earlier else {}
        self.logger = TensorBoardLogger(self.run, name="", version="tensorboard", default_hp_metric=False, **kwargs)
        if mode == "resume" and not earlier:  # new to this run folder: the checkpoint's rows first
            self.backfill(rows)
        if kwargs and later:
            return (f"tensorboard: {_span(later)} the stopped process logged past step {first - 1} hidden by the new "
                    f"event file's restart marker (purge_step={first})")
        return None

    def log(self, metrics, step):
        super().log(metrics, step)
        self.logger.save()  # flush: each step's events are on disk when it ends


class _Wandb(_RunLogger):
    def start(self, mode, rows, ids, hparams, later):
        from lightning.pytorch.loggers import WandbLogger

        known = ids.get("wandb") if mode == "resume" else None
        run_id = known or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        ids["wandb"] = run_id
        # Offline through wandb.init's own mode (the logger's offline=True would set WANDB_MODE for the
        # whole process); files under <run>/wandb; the id resumes (resume="allow" is the logger's default).
        self.logger = WandbLogger(
            name=self.run.name, save_dir=str(self.run), id=run_id, project=os.environ.get("WANDB_PROJECT", "nemo_replay"),
            mode="offline",
        )
        self.logger.experiment  # noqa: B018 -- starts the run now, not at the first step
        if known is None:
            self.logger.log_hyperparams(hparams)
            if mode == "resume":  # new to this run folder: the checkpoint's rows first
                self.backfill(rows)
        elif later:
            return (f"wandb: the offline files of run {run_id} keep the stopped process's values of {_span(later)}; "
                    f"this process logs them again")
        return None

    def log(self, metrics, step):
        # W&B's own step is the trainer's step: each process's offline files then carry the steps
        # they logged, and the folders of one run synced in order continue one another.
        # ``trainer/global_step`` is the x-axis Lightning's logger defines for the run.
        self.logger.experiment.log({**numeric_fields(metrics), "trainer/global_step": step}, step=step)

    def close(self, status):
        if self.logger is None:
            return
        run = self.logger.experiment
        if status == "stopped":
            run.mark_preempting()
        run.finish(exit_code=0 if status in ("success", "stopped") else 1)


class _MLflow(_RunLogger):
    STATUS = {"success": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def start(self, mode, rows, ids, hparams, later):
        # MLflow 3 keeps its file store in maintenance mode behind this switch; the run folder's own
        # store is the point of this logger (no server, nothing outside the run folder).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from lightning.pytorch.loggers import MLFlowLogger

        known = ids.get("mlflow") if mode == "resume" else None
        uri = (self.run / "mlruns").resolve().as_uri()
        self.logger = MLFlowLogger(experiment_name="nemo_replay", run_name=self.run.name, tracking_uri=uri, run_id=known)
        client = self.logger.experiment
        ids["mlflow"] = self.logger.run_id
        if known is not None:
            client.update_run(known, status="RUNNING")
            if later:
                return (f"mlflow: run {known} keeps the stopped process's values of {_span(later)}; this process logs "
                        f"them again (the run's latest value of a step is this process's)")
            return None
        self.logger.log_hyperparams(hparams)
        if mode == "resume":  # new to this run folder: the checkpoint's rows first
            self.backfill(rows)
        return None

    def close(self, status):
        if self.logger is not None:
            self.logger.finalize(self.STATUS[status])


LOGGERS: dict[str, LoggerSpec] = {
    spec.name: spec
    for spec in (
        LoggerSpec("jsonl", "metrics.jsonl", (), None, _Jsonl),
        LoggerSpec("csv", "csv/metrics.csv", (), None, _Csv),
        LoggerSpec("tensorboard", "tensorboard/", ("tensorboard", "tensorboardX"), "tensorboard", _TensorBoard),
        LoggerSpec("wandb", "wandb/ (offline)", ("wandb",), "wandb", _Wandb),
        LoggerSpec("mlflow", "mlruns/ (file store)", ("mlflow",), "mlflow", _MLflow),
    )
}


def logger_problems(names: Sequence[str]) -> list[str]:
    """Every problem of a ``trainer.loggers`` value, one line each naming the fix."""
    names = list(names)
    known = ", ".join(LOGGERS)
    out = []
    for name in dict.fromkeys(names):
        if name not in LOGGERS:
            close = difflib.get_close_matches(str(name), list(LOGGERS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"trainer.loggers: unknown logger {name!r}{hint}; known loggers: {known}. Fix the name or remove it")
        elif names.count(name) > 1:
            out.append(f"trainer.loggers lists {name} {names.count(name)} times; list each logger once")
        else:
            why = LOGGERS[name].missing()
            if why:
                out.append(why)
    if "jsonl" not in names:
        fixed = ",".join(["jsonl", *[n for n in names if n != "jsonl"]])
        out.append(
            f"trainer.loggers={names} leaves out jsonl, which every run writes (resume, the plots and summary.json "
            f"read metrics.jsonl); list it: trainer.loggers=[{fixed}]"
        )
    return out


class RunLoggers:
    """The loggers of one run, on global rank 0 (on other ranks every call does nothing).

    Args:
        names: ``trainer.loggers`` (validated: :func:`logger_problems`).
        run: the run folder.
        active: whether this process logs (global rank 0).
    """

    def __init__(self, names: Sequence[str], run: Path, *, active: bool):
        self.run = Path(run)
        self.active = active
        self.names = list(names)
        self.started: list[_RunLogger] = []
        self.jsonl_path = self.run / "metrics.jsonl"
        self.jsonl_side: Optional[Path] = None

    def start(self, mode: str, rows: Sequence[dict] = (), hparams: Optional[dict] = None) -> list[str]:
        """Open every logger for a ``new`` run, a ``restart`` from step 0, or a ``resume`` after ``rows``.

        Returns lines for the run's log (what resuming did past the checkpoint, new runs in
        place of earlier ones). Raises ValueError naming the extra to install when a logger's
        package does not import.
        """
        assert mode in ("new", "restart", "resume"), mode
        if not self.active:
            return []
        problems = logger_problems(self.names)
        if problems:
            raise ValueError("; ".join(problems))
        rows = list(rows)
        ids_path = self.run / IDS_FILE
        saved = json.loads(ids_path.read_text(encoding="utf-8")) if ids_path.exists() else {}
        # A restart from step 0 opens new W&B / MLflow runs: the earlier ones hold the rows moved aside.
        ids = {} if mode == "restart" else dict(saved)
        notes, later = [], []
        for name in ["jsonl", *[n for n in self.names if n != "jsonl"]]:
            one = LOGGERS[name].make(self.run)
            try:
                note = one.start(mode, rows, ids, hparams or {}, later)
            except ImportError as exc:
                raise ValueError(LOGGERS[name].missing() or f"trainer.loggers: {name} cannot load ({exc})") from exc
            self.started.append(one)
            if name == "jsonl":
                self.jsonl_side = one.side
                later = _steps_in(one.side) if mode == "resume" else []
            if note:
                notes.append(note)
            if mode == "restart" and saved.get(name) and ids.get(name) != saved[name]:
                notes.append(f"{name}: new run {ids[name]}; the earlier rows are in run {saved[name]}")
        if {**saved, **ids} != saved:
            from nemo_replay.trainer.loggers.metrics import write_atomic

            write_atomic(ids_path, json.dumps({**saved, **ids}, indent=2) + "\n")
        return notes

    def log(self, metrics: dict, step: int) -> None:
        """One row (the trainer's metrics of ``step``) to every logger, the JSONL first."""
        for one in self.started:
            one.log(metrics, step)

    def close(self, status: str) -> None:
        """End every logger's run: ``success``, ``stopped`` (a stop signal; resumable) or ``failed``."""
        started, self.started = self.started, []
        for one in reversed(started):
            one.close(status)


def _steps_in(side: Optional[Path]) -> list[int]:
    """The steps of the rows in a JSONL side file (rows moved past a checkpoint), sorted."""
    if side is None:
        return []
    steps = set()
    for line in side.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            steps.add(row["step"])
    return sorted(steps)
