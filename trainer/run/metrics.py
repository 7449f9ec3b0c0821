"""The run's metrics writer: RUN_DIR/metrics.jsonl, one JSON line per event, and TensorBoard.

A run resumed from a checkpoint retakes what its killed predecessor did after that checkpoint;
so that the records equal the uninterrupted run's, :class:`Metrics` first drops the records
written after the checkpoint (metrics.jsonl rewritten atomically, to the count of records the
checkpoint saw; TensorBoard: a new event file whose ``purge_step`` hides the later events, the
kept records of the checkpoint's own step written again).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


class Metrics:
    """Appends one JSON line per event to RUN_DIR/metrics.jsonl and mirrors scalars to TensorBoard.

    ``resume``: the checkpoint state a run continues from (``step`` and, from checkpoints that
    record it, ``metrics_records``); None for a run from step 0, which keeps no earlier record.
    :attr:`records` counts the lines of metrics.jsonl (a checkpoint saves it).
    """

    def __init__(self, run_dir: Path, resume: dict[str, Any] | None = None):
        self.path = run_dir / "metrics.jsonl"
        step = int(resume["step"]) if resume is not None else 0
        kept = self._truncate(resume)
        self.records = len(kept)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events at steps >= it in earlier event files are dropped on reading.
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=step)
        except ImportError:  # tensorboard is a dependency; keep going without it if absent
            pass
        for rec in kept:  # the checkpoint's own step: purged above, so written again
            if rec.get("step") == step:
                self._scalars(rec["kind"], step, rec)

    def _truncate(self, resume: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Keep the records written before the checkpoint ``resume`` (none without one)."""
        if not self.path.exists():
            return []
        kept: list[dict[str, Any]] = []
        if resume is not None:
            lines = self.path.read_text().splitlines()
            n = resume.get("metrics_records")
            if n is not None:  # all written before the checkpoint, so whole lines
                kept = [json.loads(x) for x in lines[: int(n)]]
            else:  # by step (async runs, whose actors write here too; older checkpoints):
                # records before the checkpoint's step, and its step's train / eval records
                step = int(resume["step"])
                kept = [
                    r
                    for r in map(_record, lines)
                    if r is not None
                    and (r["step"] < step or (r["step"] == step and r["kind"] in ("train", "eval")))
                ]
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, default=_jsonable) + "\n" for r in kept))
        os.replace(tmp, self.path)
        return kept

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_jsonable) + "\n")
        self.records += 1
        self._scalars(kind, step, values)

    def _scalars(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if self.tb is None:
            return
        for k, v in values.items():
            if k in ("kind", "step", "time"):
                continue
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _record(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except ValueError:  # a line a kill cut short
        return None


def _jsonable(v):
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return str(v)
