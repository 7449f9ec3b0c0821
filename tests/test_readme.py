"""Every command of the README's CLI tour, and its Python example, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def _block(after: str, lang: str) -> str:
    text = README.read_text()
    start = text.index(after)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    return m.group(1)


def test_readme_opens_with_the_two_commands():
    first = _block("# rolloutstore", "bash").splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make demo", "make test"]


def test_cli_tour_runs_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = [c for c in _block("<!-- tour", "bash").splitlines() if c.strip()]
    assert len(commands) >= 10
    outputs = []
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
        outputs.append(p.stdout)
    assert "rollouts   2,000 in" in outputs[3]  # stats after the ingest
    assert '{"n": 2000}' in outputs[7]
    assert "evicted 1000 rollouts, 1000 left" in outputs[9]
    assert (tmp_path / "runs/tour/positive.parquet").stat().st_size > 0


def test_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _block("## Python", "python")
    exec(compile(code, "README.md", "exec"), {})
    from rolloutstore import RolloutStore

    assert RolloutStore.open(tmp_path / "runs/demo/store").count() == 1
