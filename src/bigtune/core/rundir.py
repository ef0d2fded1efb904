"""The run directory: every file a run writes, written so a crash never leaves half a file.

Layout: recipe.yaml (resolved), metrics.jsonl + metrics.csv, memory.jsonl, summary.json,
checkpoints/step-NNNNNN.ckpt, model/ (Hugging Face format).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary sibling, then rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pick_run_dir(requested: str | None, name: str) -> Path:
    """runs/<name> by default; an existing non-empty folder gets a -2, -3, ... suffix instead of being reused."""
    base = Path(requested) if requested else Path("runs") / name
    if not base.exists() or not any(base.iterdir()):
        return base
    i = 2
    while True:
        cand = base.with_name(f"{base.name}-{i}")
        if not cand.exists() or not any(cand.iterdir()):
            return cand
        i += 1


class RunDir:
    def __init__(self, path: Path, writer: bool = True):
        self.path = Path(path)
        # With several ranks only rank 0 writes files; the others read (and call the same methods).
        self.writer = writer
        self.checkpoints = self.path / "checkpoints"
        self.model = self.path / "model"
        self._csv_fields: list[str] | None = None

    def create(self) -> None:
        if not self.writer:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)

    def write_json(self, name: str, obj: Any) -> None:
        if not self.writer:
            return
        atomic_write_text(self.path / name, json.dumps(obj, indent=2, default=str) + "\n")

    def write_text(self, name: str, text: str) -> None:
        if not self.writer:
            return
        atomic_write_text(self.path / name, text)

    def append_jsonl(self, name: str, record: dict) -> None:
        if not self.writer:
            return
        # One complete line per write: a killed process loses at most the record in flight.
        with (self.path / name).open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def append_csv(self, name: str, record: dict) -> None:
        if not self.writer:
            return
        path = self.path / name
        if self._csv_fields is None:
            self._csv_fields = list(record)
            if not path.exists():
                with path.open("w", newline="") as fh:
                    csv.writer(fh).writerow(self._csv_fields)
        buf = io.StringIO()
        csv.writer(buf).writerow([record.get(k, "") for k in self._csv_fields])
        with path.open("a", newline="") as fh:
            fh.write(buf.getvalue())

    def read_jsonl(self, name: str) -> list[dict]:
        path = self.path / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def truncate_jsonl(self, name: str, keep) -> None:
        """Drop records a resumed run will write again (e.g. steps after the checkpoint)."""
        if not self.writer:
            return
        rows = [r for r in self.read_jsonl(name) if keep(r)]
        atomic_write_text(self.path / name, "".join(json.dumps(r, default=str) + "\n" for r in rows))

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}.ckpt"

    def list_checkpoints(self) -> list[Path]:
        return sorted(p for p in self.checkpoints.glob("step-*.ckpt")) if self.checkpoints.is_dir() else []

    def prune_checkpoints(self, keep_last: int) -> None:
        if not self.writer:
            return
        for old in self.list_checkpoints()[:-keep_last]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
