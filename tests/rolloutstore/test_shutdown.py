"""Clean shutdown: a script that leaves a ReplayDataset iterator unfinished exits 0, every time.

The failure this guards against (SIGABRT at interpreter exit, ~1 in 20 runs under load)
came from the prefetch thread still inside Lance/DuckDB while the interpreter tore down.
The test runs the script 200 times (``ROLLOUTSTORE_SHUTDOWN_RUNS``), three at a time on
however many cores there are, so the runs load the CPU themselves (on a 2-core machine
each process gets about two thirds of a core, as under a busy trainer).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_rows

from rolloutstore import RolloutStore

SCRIPT = """
import sys
from rolloutstore import ReplayConfig, RolloutStore
from rolloutstore.replay.loader import ReplayDataset

store = RolloutStore.open(sys.argv[1], create=False)
ds = ReplayDataset(store, ReplayConfig(window=256), batch_size=16, learner_version=1,
                   record_usage=False, prefetch=2)
it = iter(ds)
batch = next(it)
assert batch["input_ids"].shape[0] == 16
if sys.argv[2] == "second":
    next(it)
# Exit with the iterator unfinished: the prefetch thread is mid-selection.
"""

RUNS = int(os.environ.get("ROLLOUTSTORE_SHUTDOWN_RUNS", "200"))
AT_ONCE = max(3, (os.cpu_count() or 2) + 1)  # one more process than cores: always under load


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shutdown") / "store"
    s = RolloutStore.open(path, embedding_dim=8)
    for v in range(3):
        s.append(make_rows(200, seed=v, policy_version=v))
    return path


@pytest.mark.slow
def test_unfinished_iterators_exit_cleanly_under_load(store_path, tmp_path):
    script = tmp_path / "leave_unfinished.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    modes = ("first", "second")
    codes: list[tuple[int, str]] = []
    running: list[subprocess.Popen] = []
    start = time.monotonic()

    def reap(p: subprocess.Popen) -> None:
        _, err = p.communicate(timeout=120)
        codes.append((p.returncode, err[-500:]))

    try:
        for i in range(RUNS):
            if len(running) >= AT_ONCE:
                reap(running.pop(0))
            running.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(store_path), modes[i % 2]],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        while running:
            reap(running.pop(0))
    finally:
        for p in running:
            p.kill()
            p.wait()
    assert len(codes) == RUNS
    bad = [(rc, err) for rc, err in codes if rc != 0]
    print(f"shutdown runs: {len(codes)} in {time.monotonic() - start:.0f} s, failures: {len(bad)}")
    assert not bad, f"{len(bad)} of {len(codes)} runs failed: {bad[:3]}"
