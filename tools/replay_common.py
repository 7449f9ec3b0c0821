"""Helpers shared by the replay experiments (``tools/replay_vs_onpolicy.py``,
``tools/replay_sweep.py`` and its ``replay_sweep_grid.py`` and ``replay_sweep_report.py``): the
base config, a run's ``metrics.jsonl``, and the generated block of a Markdown report."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def load_base(path: Path) -> dict[str, Any]:
    """A TOML config as nested dicts (to be edited per run, then ``TrainConfig.from_dict``)."""
    return tomllib.loads(Path(path).read_text())


def copy_sections(base: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` whose sections (and their sub-tables) can be edited freely."""
    return json.loads(json.dumps(base))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (``[]`` when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(
    out: Path,
    block: str,
    head: str,
    tail: str = "\n",
    markers: tuple[str, str] = (BEGIN, END),
) -> None:
    """Replace the generated block between the ``markers`` of ``out``, keeping the text around
    it; a file without the markers (or no file) becomes ``head``, the block and ``tail``."""
    begin, end = markers
    text = out.read_text() if out.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{head}{begin}\n{block}{end}{tail}")
