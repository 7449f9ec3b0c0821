"""The store on an object store: a real S3-compatible server (moto) on 127.0.0.1.

Same data in a local folder and in ``s3://``: SQL, selection, loader batches and
exports must agree; concurrent appenders in separate processes lose nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.errors import StoreNotFoundError, ValidationError
from rolloutstore.io.proxy import proxy_batches
from rolloutstore.replay.selector import Selector

ROOT = Path(__file__).parents[2]
# The repo root first, so `rolloutstore` is the package and not the tests folder of that name.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _twin_stores(tmp_path, bucket) -> tuple[RolloutStore, RolloutStore]:
    """A local store and an s3:// store holding the same rows in the same fragments."""
    uri, options = bucket
    local = RolloutStore.open(tmp_path / "store", embedding_dim=8)
    remote = RolloutStore.open(f"{uri}/store", embedding_dim=8, storage_options=options)
    for v in range(3):
        local.append(
            proxy_batches(
                48,
                seed=v,
                start_index=48 * v,
                rollouts_per_version=48,
                mean_completion_tokens=12,
                prompt_tokens=(3, 7),
                embedding_dim=8,
                batch_rollouts=48,
            )
        )
        # The very rows the local store committed (ids, timestamps), appended to S3.
        remote.append(local.dataset().get_fragments()[-1].to_table())
    return local, remote


def test_s3_store_matches_the_local_store(tmp_path, s3_bucket):
    local, remote = _twin_stores(tmp_path, s3_bucket)
    assert remote.version == local.version and remote.count() == local.count() == 144

    q = (
        "SELECT policy_version, count(*) AS n, sum(num_completion_tokens) AS tok, "
        "round(sum(reward), 6) AS r FROM rollouts WHERE reward >= ? GROUP BY 1 ORDER BY 1"
    )
    assert remote.sql(q, [0.0]).equals(local.sql(q, [0.0]))

    cfg = ReplayConfig(seed=3, max_staleness=2)
    picks = [
        Selector(s, cfg, record_usage=False).sample(16, learner_version=2).rollout_ids
        for s in (local, remote)
    ]
    assert list(picks[0]) == list(picks[1]) and len(picks[0]) == 16

    def batches(store):
        return list(ReplayDataset(store, cfg, batch_size=8, learner_version=2, steps=2))

    for a, b in zip(batches(local), batches(remote), strict=True):
        assert a["rollout_ids"] == b["rollout_ids"]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["behavior_logprobs"], b["behavior_logprobs"])
    # The loader recorded its draws in the S3 store's usage log.
    assert remote.sql("SELECT count(*) AS n FROM usage")["n"][0].as_py() == 16

    where = "reward > 0"
    out_local = local.export(tmp_path / "l.parquet", where=where, progress=False)
    out_remote = remote.export(tmp_path / "r.parquet", where=where, progress=False)
    assert out_remote.rows == out_local.rows > 0
    assert pq.read_table(out_remote.path).equals(pq.read_table(out_local.path))

    assert remote.stats()["bytes_on_disk"] > 0  # data bytes from the manifest, not a walk


def test_s3_store_pickles_and_reopens_by_uri(tmp_path, s3_bucket):
    import pickle

    _, remote = _twin_stores(tmp_path, s3_bucket)
    snap = pickle.loads(pickle.dumps(remote.checkout(2)))
    assert snap.uri == remote.uri and snap.count() == 48 and snap.read_only


def test_missing_s3_store_is_not_created_when_asked_not_to(s3_bucket):
    uri, options = s3_bucket
    with pytest.raises(StoreNotFoundError, match="no rollout store"):
        RolloutStore.open(f"{uri}/nothing", create=False, storage_options=options)


def _objects(bucket) -> set[str]:
    import pyarrow.fs as pafs

    uri, o = bucket
    fs = pafs.S3FileSystem(
        access_key=o["aws_access_key_id"],
        secret_key=o["aws_secret_access_key"],
        endpoint_override=o["aws_endpoint"],
        region=o["aws_region"],
    )
    sel = pafs.FileSelector(uri.removeprefix("s3://"), recursive=True)
    return {f.path for f in fs.get_file_info(sel) if f.type == pafs.FileType.File}


def test_bad_row_writes_nothing_to_s3(s3_bucket):
    uri, options = s3_bucket
    store = RolloutStore.open(f"{uri}/store", storage_options=options)
    good = {
        "prompt_ids": [1, 2],
        "completion_ids": [3],
        "behavior_logprobs": [-0.1],
        "policy_version": 0,
    }
    store.append([good])
    before = (store.version, store.count(), _objects(s3_bucket))
    bad = {**good, "behavior_logprobs": [-0.1, -0.2]}  # one log-prob per completion token
    with pytest.raises(ValidationError, match="row 1.*behavior_logprobs"):
        store.append([good, bad])
    assert (store.version, store.count(), _objects(s3_bucket)) == before


WORKER = """
import json, sys
from helpers import make_rows
from append_worker import batch_size
from rolloutstore import RolloutStore
uri, options, tag, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = RolloutStore.open(uri, storage_options=options)
for i in range(n):
    rows = make_rows(batch_size(i), seed=i, run_id=tag)
    for r in rows:
        r["task"] = f"{tag}:{i}"
    store.append(rows)
"""


def test_concurrent_appenders_on_s3_lose_nothing(s3_bucket):
    uri, options = s3_bucket
    store = RolloutStore.open(f"{uri}/store", storage_options=options)
    tags, n = ["p0", "p1", "p2"], 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, f"{uri}/store", json.dumps(options), tag, str(n)],
            env=ENV,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in tags
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    from append_worker import batch_size

    expected = {f"{t}:{i}": batch_size(i) for t in tags for i in range(n)}
    got = store.sql("SELECT task, count(*) AS n, count(DISTINCT rollout_id) AS u FROM rollouts "
                    "GROUP BY 1").to_pylist()  # fmt: skip
    assert {r["task"]: r["n"] for r in got} == expected
    assert all(r["n"] == r["u"] for r in got)
    # One commit per batch: every version adds exactly one whole batch to the one before.
    assert store.version == 1 + len(expected)
    seen = set()
    for v in range(2, store.version + 1):
        snap = store.checkout(v)
        new = snap.sql("SELECT DISTINCT task FROM rollouts")["task"].to_pylist()
        (added,) = set(new) - seen
        assert snap.count() - store.checkout(v - 1).count() == expected[added]
        seen.add(added)
