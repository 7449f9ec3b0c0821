"""User errors on the command line: one `error: ...` line on stderr, exit 2, no traceback;
`--debug` shows the traceback instead. Run as real subprocesses."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import make_rows

from rolloutstore import RolloutStore


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutstore", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    s = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    s.append(make_rows(12))
    return s


def _one_error_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_map_without_equals(store, tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("{}\n")
    _one_error_line(_cli("ingest", "-q", store.uri, str(f), "--map", "reward"), "--map", "SRC=DEST")
    assert store.count() == 12


def test_sql_unknown_version(store):
    _one_error_line(_cli("sql", store.uri, "SELECT 1", "--version", "99"), "no version 99")


@pytest.mark.parametrize("kind", ["dir", "ext", "missing"])
def test_bad_ingest_files(store, tmp_path, kind):
    target = {"dir": tmp_path, "ext": tmp_path / "rows.csv", "missing": tmp_path / "no.jsonl"}[kind]
    if kind == "ext":
        target.write_text("a,b\n")
    line = _one_error_line(_cli("ingest", "-q", store.uri, str(target)))
    assert {"dir": "a directory", "ext": "unknown extension", "missing": "nothing at that path"}[
        kind
    ] in line
    assert store.count() == 12


def test_missing_store(tmp_path):
    for cmd in (["stats"], ["sql", "SELECT 1"], ["versions"], ["sample", "--learner-version", "0"]):
        _one_error_line(_cli(cmd[0], str(tmp_path / "nope"), *cmd[1:]), "no rollout store")


def test_bad_sql_and_bad_arguments(store):
    _one_error_line(_cli("sql", store.uri, "SELECT nosuch FROM rollouts"), "nosuch")
    _one_error_line(_cli("sql", store.uri, "SELECT * FROM read_csv('/etc/passwd')"))
    _one_error_line(_cli("sql", store.uri), "required")
    _one_error_line(_cli("sample", store.uri, "--learner-version", "x"), "invalid int")
    _one_error_line(_cli("nosuchcommand"), "invalid choice")


def test_trainer_errors_follow_the_same_policy(store):
    # `rescore` is rolloutstore-train's; an unknown task is the user's to fix there too, and
    # the store CLI names the command that moved in one line.
    p = subprocess.run([sys.executable, "-m", "trainer", "rescore", store.uri, "--task", "nosuch",
                        "-q"], capture_output=True, text=True, timeout=120)  # fmt: skip
    _one_error_line(p, "unknown task")
    _one_error_line(_cli("rescore", store.uri, "--task", "nosuch"), "rolloutstore-train rescore")


def test_debug_shows_the_traceback(store):
    p = _cli("sql", store.uri, "SELECT 1", "--version", "99", "--debug")
    assert p.returncode != 0 and "Traceback" in p.stderr and "UsageError" in p.stderr
