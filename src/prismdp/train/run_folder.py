"""The run folder of ``prismdp train``: what a fresh start or a resume may find in it, reading its checkpoint and its
metrics log with errors that name the file and the fix, and undoing what a run that failed before its first
checkpoint created (only prismdp's own files; never anything the user put there).

States of a folder: no run (absent, empty, or only files prismdp does not write); *started* (``metrics.jsonl`` but no
checkpoint: the run stopped before its first checkpoint); *checkpointed*; *finished* (``summary.json``).  A fresh
start needs "no run"; ``--resume`` continues a checkpointed or finished run and restarts a started one (or a folder
with no run) from step 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import atomic_path, dumps_json, write_text

__all__ = ["RunExistsError", "RunFolder", "read_metrics"]


class RunExistsError(RuntimeError):
    """The output folder already holds a run (or a file prismdp would overwrite)."""


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``.  A last line without its newline is a record cut short by a kill during its
    write: it is dropped (the step it logged is redone on resume).  Any other bad line is an error naming the file, the
    line and the fix."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as e:
            if i == len(lines):  # no newline after it: a half-written last record
                break
            raise ValueError(f"{path}:{i}: not a metrics record ({e}): {line[:80]!r}. Delete that line (or restore the "
                             "file) and run again") from None
        records.append(rec)
    return records


class RunFolder:
    CONFIG, METRICS, CHECKPOINT, SUMMARY = "config.json", "metrics.jsonl", "checkpoint.pt", "summary.json"

    def __init__(self, path):
        self.path = Path(path)
        self.created_folder = False

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    @property
    def checkpoint_path(self) -> Path:
        return self.path / self.CHECKPOINT

    def _foreign_config(self) -> bool:
        """A config.json that a prismdp run did not write (e.g. a model's): never overwritten."""
        if not self.config_path.exists():
            return False
        try:
            saved = json.loads(self.config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return True
        return not (isinstance(saved, dict) and "code_version" in saved and "dataset_size" in saved)

    def check_start(self, resume: bool) -> bool:
        """Raise :class:`RunExistsError` unless this folder may receive the run; returns whether there is a checkpoint
        to resume from (``resume`` only)."""
        if self._foreign_config():
            raise RunExistsError(f"{self.config_path} exists and was not written by prismdp train; choose another "
                                 "--output (a run folder's config.json would replace it)")
        if resume:
            return self.checkpoint_path.is_file()
        if self.checkpoint_path.exists() or (self.path / self.SUMMARY).exists():
            raise RunExistsError(f"{self.path} already holds a run with a checkpoint; pass --resume to continue it or "
                                 "choose another --output")
        if self.metrics_path.exists():
            logged = len(read_metrics(self.metrics_path))
            raise RunExistsError(f"{self.path} holds a run that stopped before its first checkpoint ({logged} step(s) "
                                 "logged, none saved); pass --resume to restart it from step 0, or choose another "
                                 "--output")
        return False

    def load_checkpoint(self) -> dict:
        try:
            ckpt = torch.load(self.checkpoint_path, weights_only=False, map_location="cpu")
            if not (isinstance(ckpt, dict) and {"step", "config", "private"} <= set(ckpt)):
                raise ValueError("not a prismdp checkpoint")
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
            raise ValueError(
                f"{self.checkpoint_path} cannot be read ({type(e).__name__}: {e}); it is truncated or damaged (the "
                "run writes it atomically, so it was changed outside prismdp). Restore it from a copy, or move it away "
                "and pass --resume to restart the run from step 0") from None
        return ckpt

    def prepare(self, kept_records: list[dict]) -> None:
        """Create the folder if needed; ``metrics.jsonl`` keeps ``kept_records`` (those up to the checkpoint)."""
        if not self.path.exists():
            self.path.mkdir(parents=True)
            self.created_folder = True
        write_text(self.metrics_path, "".join(dumps_json(r) + "\n" for r in kept_records))

    def save_checkpoint(self, state: dict) -> None:
        with atomic_path(self.checkpoint_path) as tmp:
            torch.save(state, tmp)

    def undo(self) -> None:
        """After a failure before any checkpoint: remove this run's config.json and metrics.jsonl, and the folder if
        this run created it and nothing else is in it."""
        if self.checkpoint_path.exists():
            return
        for p in (self.metrics_path, self.config_path):
            p.unlink(missing_ok=True)
        if self.created_folder:
            try:
                self.path.rmdir()  # only if empty
            except OSError:
                pass
