"""Query limits: a timeout interrupts a long query (API and CLI); Ctrl-C stops one at once."""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import make_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutstore import QueryError, RolloutStore
from rolloutstore.cli.main import main
from rolloutstore.errors import QueryTimeoutError
from rolloutstore.query.limits import MAX_TIMEOUT, MIN_TIMEOUT, limits

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
    with pytest.raises(QueryError, match="timeout must be a number of seconds from 0.001"):
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
@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGINT, 130, "error: interrupted"),
        (signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
    ],
)
def test_sigint_or_sigterm_stops_a_running_query_promptly(store, sig, code, line):
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
        p.send_signal(sig)
        _, err = p.communicate(timeout=10)  # failure bound, not a speed claim
        latency = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    print(f"exit {latency:.2f} s after {signal.Signals(sig).name}")
    assert p.returncode == code, err
    assert err.strip().splitlines() == [line]


# -- timeouts checked, tiny ones kept (issue #31 item 10) ----------------------------------
@settings(max_examples=80, deadline=None)
@given(
    timeout=st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(0, 2 * MIN_TIMEOUT)
    | st.floats(MAX_TIMEOUT / 2, 2 * MAX_TIMEOUT)
    | st.integers(-(10**20), 10**20)
)
def test_a_timeout_is_a_finite_number_of_seconds_in_range(store, timeout):
    if math.isfinite(timeout) and MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        try:  # accepted: it answers, or (a few ms on a busy machine) hits its own limit
            assert store.sql("SELECT 1 AS x", timeout=timeout)["x"][0].as_py() == 1
        except QueryTimeoutError:
            assert timeout < 1
    else:  # refused before the query: no watchdog thread dying on it, no unbounded query
        with pytest.raises(QueryError, match="timeout must be a number of seconds"):
            store.sql("SELECT 1 AS x", timeout=timeout)


@pytest.mark.parametrize("value", ["inf", "1e300", "1e-9", "nan", "0", "-2", "soon"])
def test_cli_refuses_a_bad_timeout_in_one_line_and_writes_nothing(store, tmp_path, capsys, value):
    out = tmp_path / "o.jsonl"
    for argv in (
        ["sql", store.uri, "SELECT 1 AS x", "--timeout", value, "--out", str(out)],
        ["export", store.uri, str(out), "--timeout", value, "-q"],
    ):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "--timeout" in lines[0]
        assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("timeout", [MIN_TIMEOUT, 0.02])
def test_a_deadline_reached_before_the_query_starts_still_interrupts(store, timeout):
    con = store.connect()
    safety = threading.Timer(20, con.interrupt)  # a lost interrupt: LONG would run for hours
    safety.start()
    try:
        start = time.monotonic()
        with pytest.raises(QueryTimeoutError), limits(con, timeout):
            time.sleep(timeout + 0.1)  # the deadline passes before the query starts
            con.sql(LONG).fetchall()
        assert time.monotonic() - start < 10  # failure bound: the safety net fires at 20 s
    finally:
        safety.cancel()
        con.close()
