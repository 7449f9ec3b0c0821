"""The run's metrics writer: RUN_DIR/metrics.jsonl, one JSON line per event, and TensorBoard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np


class Metrics:
    """Appends one JSON line per event to RUN_DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboard is a dependency; keep going without it if absent
            pass

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_jsonable) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _jsonable(v):
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return str(v)
