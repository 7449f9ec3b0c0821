"""Every command of the README's CLI tour, and its Python example, run as written."""

from __future__ import annotations

import json
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
    out = {}
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
        out.setdefault(" ".join(cmd.split()[:2]), []).append(p.stdout)
    assert "generated 64 rollouts" in out["rolloutstore generate"][0]
    assert "rollouts   2,000 in" in out["rolloutstore stats"][0]  # stats after the ingest
    assert '{"n": 2000}' in out["rolloutstore sql"][-1]  # the query of version 2
    assert "(8 rows)" in out["rolloutstore sample"][0]
    assert "ORDER BY policy_version DESC" in out["rolloutstore sample"][1]
    assert "exported 2000 rows" in out["rolloutstore export"][0]
    assert "ingested 2000 rollouts" in out["rolloutstore ingest"][1]
    assert "evicted 500 rollouts, 1500 left" in out["rolloutstore evict"][0]
    diverse = out["rolloutstore evict"][1]  # exactly --keep rows, plus the coverage report
    assert "evicted 500 rollouts, 1000 left" in diverse and "FIFO" in diverse
    assert (tmp_path / "runs/tour/positive.parquet").stat().st_size > 0


def test_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_block("## Python", "python"), "README.md", "exec"), {})
    from rolloutstore import RolloutStore

    assert RolloutStore.open(tmp_path / "runs/demo/store").count() == 1
    exec(compile(_block("## Replay", "python"), "README.md", "exec"), {})
    assert (
        RolloutStore.open(tmp_path / "runs/demo/store")
        .sql("SELECT count(*) AS n FROM usage")["n"][0]
        .as_py()
        >= 1
    )


def test_own_model_and_data_runs_as_written(tmp_path):
    """The "Your own model and data" commands, from a folder that has the repository's tools."""
    root = README.parent
    (tmp_path / "tools").symlink_to(root / "tools")
    (tmp_path / "my-run.toml").write_text(_block("<!-- own-data", "toml"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    commands = [c for c in _block("<!-- own-data", "bash").splitlines() if c.strip()]
    assert len(commands) == 4
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["prompt_text"].startswith("<|user|>\n")  # the tiny model's chat template
        assert row["prompt_text"].endswith("<|assistant|>\n")
        info = json.loads(row["reward_info"])
        assert info["reward_fn"] == "math" and info["reward_fn_version"].startswith("math-verify/")


def test_multiturn_commands_run_as_written(tmp_path):
    """The "Multi-turn trajectories" commands, from a folder with the repository's tools and
    test data."""
    root = README.parent
    (tmp_path / "tools").symlink_to(root / "tools")
    (tmp_path / "tests").symlink_to(root / "tests")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    commands = [c for c in _block("<!-- multiturn", "bash").splitlines() if c.strip()]
    assert len(commands) == 7
    out = []
    for cmd in commands:
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
        out.append(p.stdout)
    assert "ingested 4 rollouts" in out[1]
    assert "calculator" in out[2] and "(4 rows)" in out[2]
    assert "tool" in out[3] and "user" in out[3]
    assert "(2 rows)" in out[4]
    assert "exported 4 rows (messages, jsonl)" in out[5]
    assert "already rollout schema v2; nothing to do" in out[6]
    chats = [json.loads(line) for line in (tmp_path / "runs/agent/chats.jsonl").open()]
    assert {m["role"] for c in chats for m in c["messages"]} == {"system", "user", "assistant",
                                                                  "tool"}  # fmt: skip
