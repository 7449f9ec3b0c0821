from __future__ import annotations

import json
import pickle
import uuid
from datetime import UTC, datetime, timedelta

import lance
import numpy as np
import pyarrow as pa
import pytest
from helpers import make_rows

from rolloutstore import (
    QueryError,
    ReadOnlyError,
    RolloutStore,
    SchemaError,
    SchemaVersionError,
    StoreNotFoundError,
)
from rolloutstore.io.proxy import proxy_batches, proxy_table
from rolloutstore.schema import spec as S
from rolloutstore.schema.ids import prompt_id_of

DESIGN_COLUMNS = [
    "rollout_id",
    "run_id",
    "prompt_id",
    "group_id",
    "sample_index",
    "policy_version",
    "policy_id",
    "tokenizer_fingerprint",
    "prompt_ids",
    "completion_ids",
    "behavior_logprobs",
    "prompt_text",
    "completion_text",
    "finish_reason",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "logprobs_mode",
    "generator",
    "reward",
    "reward_info",
    "advantage",
    "embedding",
    "created_at",
    "num_prompt_tokens",
    "num_completion_tokens",
    "task",
    "tags",
    "metadata",
]
# Schema v2 (multi-turn trajectories) appends these, in this order.
V2_COLUMNS = ["loss_mask", "turns", "num_turns", "num_model_tokens", "num_tool_calls", "tools"]


def test_schema_has_every_design_column_from_the_json_file():
    spec = json.loads((S.SCHEMA_DIR / "rollout.v2.json").read_text())
    names = [c["name"] for c in spec["columns"]]
    assert names == S.rollout_schema().names == DESIGN_COLUMNS + V2_COLUMNS
    v1 = json.loads((S.SCHEMA_DIR / "rollout.v1.json").read_text())
    assert [c["name"] for c in v1["columns"]] == S.rollout_schema(version=1).names
    assert sorted(S.rollout_schema(version=1).names) == sorted(DESIGN_COLUMNS)
    assert spec["tables"] == v1["tables"]
    sch = S.rollout_schema(32)
    assert sch.field("completion_ids").type == pa.list_(pa.int32())
    assert sch.field("behavior_logprobs").type.value_type == pa.float32()
    assert sch.field("embedding").type == pa.list_(pa.float32(), 32)
    assert not sch.field("policy_version").nullable and sch.field("reward").nullable
    assert all(c["description"] for c in spec["columns"])
    assert sch.field("loss_mask").type == pa.list_(pa.int8())
    assert sch.field("loss_mask").type.value_field.metadata[b"lance-encoding:compression"] == (
        b"zstd"
    )
    turn = sch.field("turns").type.value_type
    assert [(f.name, f.type) for f in turn] == [
        ("role", pa.string()), ("start", pa.int32()), ("end", pa.int32()),
        ("tool_name", pa.string()),
    ]  # fmt: skip
    assert sch.field("turns").nullable and not sch.field("num_turns").nullable


def test_open_creates_and_records_version_and_dim(tmp_path):
    with pytest.raises(StoreNotFoundError):
        RolloutStore.open(tmp_path / "missing", create=False)
    s = RolloutStore.open(tmp_path / "s", embedding_dim=16)
    assert s.embedding_dim == 16 and s.count() == 0
    meta = s.dataset().schema.metadata
    assert meta[b"rolloutstore.schema_version"] == b"2" and s.schema_version == 2
    assert RolloutStore.open(tmp_path / "s").embedding_dim == 16
    with pytest.raises(SchemaError, match="embedding_dim 16"):
        RolloutStore.open(tmp_path / "s", embedding_dim=8)


def test_newer_schema_version_refused(tmp_path):
    root = tmp_path / "future"
    sch = S.rollout_schema().with_metadata({b"rolloutstore.schema_version": b"3"})
    lance.write_dataset(sch.empty_table(), str(root / "rollouts.lance"), schema=sch)
    with pytest.raises(SchemaVersionError, match="v3.*reads v1 to v2; update rolloutstore"):
        RolloutStore.open(root)


def test_append_fills_defaults(store):
    rows = make_rows(5)
    for r in rows:
        r.pop("group_id")
    res = store.append(rows)
    assert res.rows == 5 and res.version == store.version
    t = store.dataset().to_table()
    for i, r in enumerate(t.to_pylist()):
        assert uuid.UUID(r["rollout_id"]).version == 7
        assert r["prompt_id"] == prompt_id_of(rows[i]["prompt_ids"])
        assert r["num_prompt_tokens"] == len(rows[i]["prompt_ids"])
        assert r["num_completion_tokens"] == len(rows[i]["completion_ids"])
        assert abs(r["created_at"] - datetime.now(UTC)) < timedelta(minutes=5)
    assert len(set(t["group_id"].to_pylist())) == 5
    assert t["rollout_id"].to_pylist() == sorted(t["rollout_id"].to_pylist())


def test_round_trip_is_lossless_and_one_commit_per_append(store):
    batches = list(proxy_batches(300, seed=3, batch_rollouts=96, group_size=8))
    v0 = store.version
    res = store.append(iter(batches))
    assert res.rows == 300 and res.version == v0 + 1
    src = pa.concat_tables(batches)
    got = store.dataset().to_table()
    for col in ("prompt_ids", "completion_ids", "behavior_logprobs", "embedding", "reward"):
        assert got[col].to_pylist() == src[col].to_pylist(), col
    lp = got["behavior_logprobs"].combine_chunks().values.to_numpy()
    assert lp.dtype == np.float32
    np.testing.assert_array_equal(lp, src["behavior_logprobs"].combine_chunks().values.to_numpy())


def test_checkout_is_a_read_only_snapshot(store):
    v1 = store.append(make_rows(3)).version
    store.append(make_rows(4, seed=1))
    snap = store.checkout(v1)
    assert snap.count() == 3 and store.count() == 7
    assert snap.sql("SELECT count(*) AS n FROM rollouts")["n"][0].as_py() == 3
    with pytest.raises(ReadOnlyError):
        snap.append(make_rows(1))


def test_pickle_reopens_by_uri(store):
    store.append(make_rows(2))
    clone = pickle.loads(pickle.dumps(store))
    assert clone.uri == store.uri and clone.count() == 2
    store.append(make_rows(3, seed=2))
    assert clone.count() == 5  # an unpinned store follows the latest version
    pinned = pickle.loads(pickle.dumps(store.checkout(2)))
    assert pinned.count() == 2


def test_sql_views_and_params(store):
    store.append(make_rows(40, seed=4, policy_version=1))
    store.append(make_rows(40, seed=5, policy_version=2))
    t = store.sql("SELECT count(*) AS n FROM rollouts WHERE policy_version = ?", [2])
    assert t["n"][0].as_py() == 40
    g = store.sql("SELECT * FROM groups ORDER BY group_id").to_pylist()
    all_rows = store.dataset().to_table().to_pylist()
    for grp in g:
        rewards = [r["reward"] for r in all_rows if r["group_id"] == grp["group_id"]]
        assert grp["n"] == len(rewards)
        assert grp["reward_mean"] == pytest.approx(np.mean(rewards))
        assert grp["reward_std"] == pytest.approx(np.std(rewards))
    named = store.sql("SELECT count(*) AS n FROM rollouts WHERE policy_version = $v", {"v": 1})
    assert named["n"][0].as_py() == 40


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "COPY (SELECT 1) TO '/tmp/rolloutstore-should-not-exist.csv'",
        "SET enable_external_access = true",
        "ATTACH '/tmp/x.duckdb' AS x",
        "INSTALL httpfs",
    ],
)
def test_sql_cannot_touch_files(store, query):
    store.append(make_rows(2))
    with pytest.raises(QueryError):
        store.sql(query)
    # and the store is still scannable after a refused query
    assert store.sql("SELECT count(*) AS n FROM rollouts")["n"][0].as_py() == 2


def test_usage_and_stats(store):
    store.append(make_rows(10, policy_version=0))
    store.append(make_rows(6, seed=1, policy_version=3))
    ids = store.sql("SELECT rollout_id FROM rollouts ORDER BY rollout_id LIMIT 4")
    ids = ids["rollout_id"].to_pylist()
    store.record_usage(ids, learner_step=1)
    store.record_usage(ids[:1], learner_step=2)
    st = store.stats()
    assert st["rows"] == 16
    assert st["tokens"] == st["prompt_tokens"] + st["completion_tokens"] > 0
    assert st["bytes_on_disk"] > 0 and st["bytes_per_token"] > 0
    assert {r["policy_version"]: r["rollouts"] for r in st["by_policy_version"]} == {0: 10, 3: 6}
    assert {r["uses"]: r["rollouts"] for r in st["reuse"]} == {0: 12, 1: 3, 2: 1}


def test_evict_keep_last_keeps_the_most_recent(store):
    for v in range(4):
        store.append(make_rows(25, seed=v, policy_version=v))
    before = store.dataset().to_table(columns=["rollout_id", "policy_version", "created_at"])
    order = sorted(
        before.to_pylist(),
        key=lambda r: (r["policy_version"], r["created_at"], r["rollout_id"]),
        reverse=True,
    )
    res = store.evict(keep_last=30)
    assert res.rows_deleted == 70 and res.rows_left == 30 == store.count()
    kept = set(store.sql("SELECT rollout_id FROM rollouts")["rollout_id"].to_pylist())
    assert kept == {r["rollout_id"] for r in order[:30]}
    snap = store.checkout(res.version - 1)
    assert snap.count() == 100  # eviction is a new version, never a silent rewrite


def test_evict_by_version_and_age(store):
    old = make_rows(5, policy_version=0)
    for r in old:
        r["created_at"] = datetime(2020, 1, 1, tzinfo=UTC)
    store.append(old)
    store.append(make_rows(5, seed=1, policy_version=1))
    store.append(make_rows(5, seed=2, policy_version=2))
    assert store.evict(older_than=timedelta(days=1)).rows_deleted == 5
    assert store.evict(min_policy_version=2).rows_deleted == 5
    assert store.sql("SELECT DISTINCT policy_version AS v FROM rollouts")["v"].to_pylist() == [2]
    with pytest.raises(ValueError):
        store.evict()


def test_compact_merges_fragments_and_keeps_rows(store):
    for i in range(6):
        store.append(make_rows(7, seed=i))
    before = store.dataset().to_table().sort_by("rollout_id")
    assert len(store.dataset().get_fragments()) == 6
    store.compact()
    assert len(store.dataset().get_fragments()) == 1
    assert store.dataset().to_table().sort_by("rollout_id").equals(before)


def test_compression_beats_parquet_zstd(tmp_path):
    # The storage claim that decides the default encoding (docs/benchmarks.md).
    import pyarrow.parquet as pq

    table = proxy_table(2000, seed=7, mean_completion_tokens=256)
    s = RolloutStore.open(tmp_path / "s")
    s.append(table)
    pq.write_table(table, tmp_path / "p.parquet", compression="zstd")
    assert s.bytes_on_disk() < (tmp_path / "p.parquet").stat().st_size


def test_usage_log_stays_compact_and_keeps_every_row(store):
    from rolloutstore.store.side_tables import USAGE_MAX_FRAGMENTS

    store.append(make_rows(3))
    ids = store.sql("SELECT rollout_id FROM rollouts")["rollout_id"].to_pylist()
    for step in range(USAGE_MAX_FRAGMENTS + 5):
        store.record_usage(ids, learner_step=step)
    assert len(store.usage_dataset().get_fragments()) <= USAGE_MAX_FRAGMENTS
    n = store.sql("SELECT count(*) AS n, count(DISTINCT learner_step) AS s FROM usage").to_pylist()
    assert n == [{"n": 3 * (USAGE_MAX_FRAGMENTS + 5), "s": USAGE_MAX_FRAGMENTS + 5}]
