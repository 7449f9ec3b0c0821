"""Query limits: a timeout interrupts a long query (API and CLI); Ctrl-C stops one at once."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_rows

from rolloutstore import QueryError, RolloutStore
from rolloutstore.errors import QueryTimeoutError

# A cross join of 10^13 pairs: runs for hours unless interrupted.
LONG = "SELECT count(*) AS n FROM range(100000000) a, range(100000) b WHERE a.range + b.range = 7"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> RolloutStore:
    s = RolloutStore.open(tmp_path_factory.mktemp("limits") / "s", embedding_dim=8)
    s.append(make_rows(8))
    return s


def test_api_timeout_interrupts_and_the_store_still_answers(store):
    with pytest.raises(QueryTimeoutError, match="time limit of 0.5 s") as exc:
        store.sql(LONG, timeout=0.5)
    assert isinstance(exc.value, QueryError) and isinstance(exc.value, TimeoutError)
    assert store.sql("SELECT count(*) AS n FROM rollouts", timeout=30)["n"][0].as_py() == 8
    with pytest.raises(QueryError, match="timeout must be > 0"):
        store.sql("SELECT 1", timeout=0)


def test_cli_timeout_is_one_line(store, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "rolloutstore", "sql", store.uri, LONG, "--timeout", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: the query ran past its time limit of 1 s and was interrupted; narrow it "
        "(a WHERE, a LIMIT) or raise --timeout / timeout="
    ]


def test_export_where_timeout(store, tmp_path):
    where = "rollout_id IN (SELECT 1)"  # refused: no subquery can make it slow
    p = subprocess.run(
        [sys.executable, "-m", "rolloutstore", "export", store.uri, str(tmp_path / "o.parquet"),
         "--where", where, "--timeout", "1", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "subquery" in p.stderr
    # The API bound covers the streamed export query too.
    r = store.export(tmp_path / "ok.parquet", where="reward >= ?", params=[0], timeout=30,
                     progress=False)  # fmt: skip
    assert r.rows == 8


def _cpu_of_children() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_sigint_stops_a_running_query_promptly(store):
    cmd = [sys.executable, "-m", "rolloutstore", "sql", store.uri]
    before = _cpu_of_children()
    subprocess.run([*cmd, "SELECT 1"], capture_output=True, check=True, timeout=120)
    startup_cpu = _cpu_of_children() - before  # CPU seconds to start and answer a tiny query

    p = subprocess.Popen([*cmd, LONG], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait (bounded) until the process has clearly been running the query for a while.
        deadline = time.monotonic() + 120
        while _cpu_of(p.pid) < startup_cpu + 2.0:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the query never started"
            time.sleep(0.1)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=10)  # failure bound, not a speed claim
        latency = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    print(f"exit {latency:.2f} s after SIGINT")
    assert p.returncode == 130, err
    assert err.strip().splitlines() == ["error: interrupted"]
