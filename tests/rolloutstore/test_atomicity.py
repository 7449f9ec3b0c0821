"""Crash safety and concurrency with real processes: SIGKILL mid-append, parallel appenders."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from append_worker import batch_size

from rolloutstore import RolloutStore

WORKER = Path(__file__).parents[1] / "append_worker.py"
ROOT = WORKER.parents[1]
# The repo root first, so `rolloutstore` is the package and not the tests folder of that name.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _spawn(store: Path, tag: str, n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(store), tag, str(n)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_whole_batches(store: RolloutStore) -> dict[str, int]:
    """Every batch present is complete and every row is whole; returns rows per tag."""
    per_batch = store.sql(
        "SELECT task, count(*) AS n, count(DISTINCT rollout_id) AS ids FROM rollouts GROUP BY task"
    ).to_pylist()
    per_tag: dict[str, int] = {}
    for b in per_batch:
        tag, _, size = b["task"].split(":")
        assert b["n"] == b["ids"] == int(size), b
        per_tag[tag] = per_tag.get(tag, 0) + b["n"]
    broken = store.sql(
        "SELECT count(*) AS n FROM rollouts WHERE len(completion_ids) <> num_completion_tokens "
        "OR len(behavior_logprobs) <> len(completion_ids) OR len(prompt_ids) <> num_prompt_tokens "
        "OR rollout_id IS NULL OR prompt_id IS NULL OR created_at IS NULL"
    )["n"][0].as_py()
    assert broken == 0
    return per_tag


def test_sigkill_mid_append_never_leaves_partial_batches(tmp_path):
    path = tmp_path / "store"
    RolloutStore.open(path)
    rng = random.Random(0)
    killed_after = []
    for round_ in range(4):
        proc = _spawn(path, f"k{round_}", 10_000)
        # Wait until it has committed something, then kill it at a random point.
        assert proc.stdout.readline() != "", proc.stderr.read()
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_after.append(proc.returncode)
        store = RolloutStore.open(path, create=False)
        per_tag = _check_whole_batches(store)
        assert per_tag.get(f"k{round_}", 0) > 0
    assert all(rc == -signal.SIGKILL for rc in killed_after)
    # The store still takes appends after the crashes.
    store = RolloutStore.open(path, create=False)
    n = store.count()
    store.append(
        store.sql(
            "SELECT prompt_ids, completion_ids, behavior_logprobs, policy_version "
            "FROM rollouts LIMIT 3"
        )
    )
    assert store.count() == n + 3


@pytest.mark.slow
def test_two_appenders_and_a_reader_see_every_row_once(tmp_path):
    path = tmp_path / "store"
    RolloutStore.open(path)
    n = 12
    writers = [_spawn(path, tag, n) for tag in ("a", "b")]
    reader = RolloutStore.open(path, create=False)
    seen = []
    while any(w.poll() is None for w in writers):
        seen.append(reader.count())
        time.sleep(0.05)
    for w in writers:
        assert w.returncode == 0, w.stderr.read()
    assert seen == sorted(seen)  # a reader never sees rows disappear
    expected = sum(batch_size(i) for i in range(n))
    per_tag = _check_whole_batches(reader)
    assert per_tag == {"a": expected, "b": expected}
    ids = reader.sql("SELECT count(*) AS n, count(DISTINCT rollout_id) AS d FROM rollouts")
    assert ids["n"][0].as_py() == ids["d"][0].as_py() == 2 * expected
