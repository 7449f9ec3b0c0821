"""Stores written with rollout schema v1 (before multi-turn trajectories): they open and read
as before, in v2 terms (one model turn per row) through every read path; single-turn rows
still append; a multi-turn row is refused naming `rolloutstore migrate`; `migrate` upgrades
in one atomic commit (a failure or a kill before it leaves the v1 store as it was)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import make_rows

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore, Selector
from rolloutstore.cli import main
from rolloutstore.errors import ValidationError
from rolloutstore.store import layout
from rolloutstore.store import migrate as M

ROOT = Path(__file__).resolve().parents[2]
V2_ONLY = ["loss_mask", "turns", "num_turns", "num_model_tokens", "num_tool_calls", "tools"]


def v1_store(path, n: int = 12, appends: int = 2) -> RolloutStore:
    """A store as rolloutstore wrote it before schema v2 (v1 dataset, v1 rows)."""
    layout.create(str(path), 4, None, schema_version=1)
    store = RolloutStore.open(path)
    for k in range(appends):
        store.append(make_rows(n, seed=k, run_id=f"r{k}"))
    return store


def trajectory() -> dict:
    return {
        "prompt_ids": [1, 2], "completion_ids": [5, 6, 7, 8],
        "behavior_logprobs": [-0.5, 0.0, 0.0, -0.5], "loss_mask": [1, 0, 0, 1],
        "turns": [{"role": "assistant", "start": 0, "end": 1},
                  {"role": "tool", "start": 1, "end": 3, "tool_name": "calculator"},
                  {"role": "assistant", "start": 3, "end": 4}],
        "policy_version": 0,
    }  # fmt: skip


def _data_files(store) -> set[str]:
    return set(os.listdir(os.path.join(store.uri, "rollouts.lance", "data")))


def test_v1_store_reads_as_one_model_turn_everywhere(tmp_path):
    store = v1_store(tmp_path / "v1")
    assert store.schema_version == 1 and "loss_mask" not in store.dataset().schema.names
    rows = store.sql("SELECT * FROM rollouts ORDER BY rollout_id").to_pylist()
    assert len(rows) == 24
    for r in rows:
        assert r["loss_mask"] == [1] * len(r["completion_ids"]) and r["turns"] is None
        assert (r["num_turns"], r["num_tool_calls"], r["tools"]) == (1, 0, [])
        assert r["num_model_tokens"] == r["num_completion_tokens"]
    turns = store.sql("SELECT count(*) AS n, min(turn) AS t, sum(num_tokens) AS k FROM turns")
    total = sum(len(r["completion_ids"]) for r in rows)
    assert turns.to_pylist() == [{"n": 24, "t": 0, "k": total}]
    took = store.take([0, 3], columns=["num_completion_tokens", "loss_mask", "num_turns"])
    assert [len(m) for m in took["loss_mask"].to_pylist()] == took[
        "num_completion_tokens"
    ].to_pylist()
    assert store.take([0]).column_names == store.schema.names
    batch = next(iter(ReplayDataset(store, ReplayConfig(seed=0), batch_size=8, steps=1,
                                    record_usage=False, prefetch=0)))  # fmt: skip
    assert batch["num_loss_tokens"] == int(batch["loss_mask"].sum()) > 0
    sel = Selector(store, ReplayConfig(where="num_turns = 1 AND num_tool_calls = 0"),
                   record_usage=False)  # fmt: skip
    assert len(sel.candidates(0)) == 24


def test_rollouts_view_is_the_same_for_every_version(tmp_path):
    v1 = v1_store(tmp_path / "v1", appends=1)
    v2 = RolloutStore.open(tmp_path / "v2", embedding_dim=4)
    v2.append(make_rows(3))
    a = v1.sql("SELECT * FROM rollouts LIMIT 1").schema
    b = v2.sql("SELECT * FROM rollouts LIMIT 1").schema
    assert [(f.name, f.type) for f in a] == [(f.name, f.type) for f in b]
    assert a.names == v2.schema.names


def test_v1_store_takes_single_turn_rows_and_refuses_trajectories(tmp_path):
    store = v1_store(tmp_path / "v1", appends=1)
    one = {**trajectory(), "loss_mask": [1, 1, 1, 1], "behavior_logprobs": [-0.5] * 4,
           "turns": [{"role": "assistant", "start": 0, "end": 4}], "num_turns": 1}  # fmt: skip
    store.append([one])
    assert store.schema_version == 1 and store.count() == 13
    before = (store.count(), store.version)
    with pytest.raises(ValidationError) as info:
        store.append(make_rows(2) + [trajectory()])
    msg = str(info.value)
    assert info.value.row == 2 and info.value.field == "turns"
    assert f"rolloutstore migrate {store.uri}" in msg and "schema v1" in msg
    assert (store.count(), store.version) == before
    masked = {**trajectory(), "turns": None, "loss_mask": [1, 0, 0, 1]}
    masked["behavior_logprobs"] = [-0.5, 0.0, 0.0, -0.5]
    with pytest.raises(ValidationError, match="field 'loss_mask'.*rolloutstore migrate"):
        store.append([masked])


def test_migrate_upgrades_in_one_commit_and_is_idempotent(tmp_path, capsys):
    store = v1_store(tmp_path / "v1")
    store.dataset().create_scalar_index("rollout_id", "BTREE")
    before_rows = store.sql("SELECT * FROM rollouts ORDER BY rollout_id")
    frags = [f.fragment_id for f in store.dataset().get_fragments()]
    v = store.version
    assert main(["migrate", store.uri]) == 0
    out = capsys.readouterr().out
    assert "from rollout schema v1 to v2 in one commit: 24 rollouts" in out
    assert f"store version {v} -> {v + 1}" in out and "loss_mask" in out
    store = RolloutStore.open(store.uri)
    assert store.schema_version == 2 and store.version == v + 1
    assert store.dataset().schema.names == store.schema.names
    assert [f.fragment_id for f in store.dataset().get_fragments()] == frags
    assert [i.name for i in store.dataset().describe_indices()]  # the index stayed
    assert store.sql("SELECT * FROM rollouts ORDER BY rollout_id").equals(before_rows)
    assert store.checkout(v).schema_version == 1  # older versions still read as v1
    assert store.checkout(v).sql("SELECT * FROM rollouts ORDER BY rollout_id").equals(before_rows)
    store.append([trajectory()])
    assert (
        store.sql("SELECT count(*) AS n FROM rollouts WHERE num_tool_calls = 1")["n"][0].as_py()
        == 1
    )
    assert main(["migrate", store.uri]) == 0  # idempotent
    assert "already rollout schema v2; nothing to do" in capsys.readouterr().out
    assert RolloutStore.open(store.uri).version == v + 2


def test_migrate_of_an_empty_v1_store(tmp_path):
    layout.create(str(tmp_path / "e"), 4, None, schema_version=1)
    r = M.migrate(RolloutStore.open(tmp_path / "e"))
    assert (r.from_version, r.to_version, r.rows) == (1, 2, 0)
    assert RolloutStore.open(tmp_path / "e").append([trajectory()]).rows == 1


def test_a_failed_migrate_leaves_the_v1_store_as_it_was(tmp_path, monkeypatch):
    store = v1_store(tmp_path / "v1")
    files, version = _data_files(store), store.version
    rows = store.sql("SELECT * FROM rollouts ORDER BY rollout_id")

    def boom(*a, **k):
        raise OSError("injected: the disk went away before the commit")

    monkeypatch.setattr(M, "_commit", boom)
    with pytest.raises(OSError, match="injected"):
        M.migrate(store)
    store = RolloutStore.open(store.uri)
    assert (store.schema_version, store.version) == (1, version)
    assert _data_files(store) == files  # the new columns' files were removed
    assert store.sql("SELECT * FROM rollouts ORDER BY rollout_id").equals(rows)
    store.append(make_rows(2, seed=9))  # still writable as v1
    monkeypatch.undo()
    assert M.migrate(store).to_version == 2


def test_a_killed_migrate_leaves_the_v1_store_readable(tmp_path):
    store = v1_store(tmp_path / "v1")
    files, version = _data_files(store), store.version
    script = textwrap.dedent(f"""
        import os
        from rolloutstore import RolloutStore
        from rolloutstore.store import migrate as M
        M._commit = lambda *a, **k: os._exit(9)  # killed between the data files and the commit
        M.migrate(RolloutStore.open({store.uri!r}))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    store = RolloutStore.open(store.uri)
    assert (store.schema_version, store.version, store.count()) == (1, version, 24)
    assert _data_files(store) > files  # written, never committed
    assert store.sql("SELECT sum(num_model_tokens) AS n FROM rollouts")["n"][0].as_py() > 0
    store.gc(min_age=timedelta(0))  # collects what the killed migrate left
    assert _data_files(store) == files
    assert M.migrate(store).to_version == 2


def test_an_append_racing_a_migrate_is_refused_clearly_and_retries(tmp_path):
    from rolloutstore.errors import SchemaVersionError

    store = v1_store(tmp_path / "v1", appends=1)
    other = RolloutStore.open(store.uri)

    def chunks():
        M.migrate(other)  # commits after this append read the store, before it commits
        yield make_rows(3, seed=5)

    with pytest.raises(SchemaVersionError, match="migrated from rollout schema v1 to v2 while"):
        store.append(chunks())
    assert store.count() == 12 and store.schema_version == 2
    assert store.append(make_rows(3, seed=5)).rows == 3  # the retry writes v2 rows


def test_maintenance_works_on_a_v1_store(tmp_path):
    store = v1_store(tmp_path / "v1")
    assert store.evict(keep_last=20).rows_left == 20
    store.compact()
    st = store.stats()
    assert st["rows"] == 20 and store.schema_version == 1
    assert store.sql("SELECT count(*) AS n FROM turns")["n"][0].as_py() == 20
