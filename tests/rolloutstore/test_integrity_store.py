"""Integrity of what enters the store: strict types, non-empty tokens, unique rollout ids,
input files read to their end, a loader that never crashes on a selectable batch, disk-full."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import make_rows, plain_selection
from hypothesis import given, settings
from hypothesis import strategies as st
from lance.dataset import DatasetOptimizer
from lance.fragment import write_fragments

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.cli import main
from rolloutstore.errors import (
    DiskFullError,
    FileUnreadableError,
    IngestError,
    ReadOnlyError,
    RolloutStoreError,
    ValidationError,
)
from rolloutstore.io.ingest import ingest_file
from rolloutstore.replay.loader import collate
from rolloutstore.schema.validate import prepare
from rolloutstore.store import log as store_mod
from rolloutstore.store import unique


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _unchanged(store: RolloutStore, before: tuple[int, int]) -> bool:
    return (store.count(), store.version) == before


def _state(store: RolloutStore) -> tuple[int, int]:
    return store.count(), store.version


# -- strict types ------------------------------------------------------------------------
def _with(i: int, **fields):
    rows = make_rows(3, seed=i)
    rows[1].update(fields)
    return rows


STRICT = [
    ("policy_version", {"policy_version": 1.5}, "1.5"),
    ("policy_version", {"policy_version": True}, "bool"),
    ("policy_version", {"policy_version": "3"}, "str"),
    ("completion_ids", {"completion_ids": [1.5, 2.7], "behavior_logprobs": [-1.0, -1.0]}, "1.5"),
    ("prompt_ids", {"prompt_ids": [1, 2.5]}, "2.5"),
    ("prompt_ids", {"prompt_ids": "12"}, "str"),
    ("tags", {"tags": "abc"}, "str"),
    ("sample_index", {"sample_index": 2**40}, "1099511627776"),
    ("policy_version", {"policy_version": 2**70}, "1180591620717411303424"),
    ("reward", {"reward": "1.0"}, "str"),
    ("metadata", {"metadata": {"a": 1}}, "dict"),
]


@pytest.mark.parametrize(("field", "change", "shown"), STRICT)
def test_strict_types_refused_naming_row_and_field(store, field, change, shown):
    store.append(make_rows(2))
    before = _state(store)
    with pytest.raises(ValidationError, match=rf"row 1, field '{field}'.*{shown}") as info:
        store.append(_with(0, **change))
    assert info.value.row == 1 and info.value.field == field
    assert _unchanged(store, before)


def test_strict_types_from_an_arrow_table(store):
    t = pa.Table.from_pylist(make_rows(3))
    bad = t.set_column(
        t.schema.get_field_index("policy_version"), "policy_version", pa.array([1.0, 2.0, 2.5])
    )
    with pytest.raises(ValidationError, match=r"row 2, field 'policy_version'"):
        store.append(bad)
    as_text = t.set_column(
        t.schema.get_field_index("policy_version"), "policy_version", pa.array(["1", "2", "3"])
    )
    with pytest.raises(ValidationError, match=r"row 0, field 'policy_version'.*string"):
        store.append(as_text)
    assert store.count() == 0


def test_integral_floats_are_accepted_exactly(store):
    """Decision: a float that is exactly integral (JSON writers emit 2.0) is that integer."""
    rows = _with(0, policy_version=2.0, completion_ids=[7.0, 8.0], behavior_logprobs=[-1, -2])
    store.append(rows)
    got = store.sql(
        "SELECT policy_version, completion_ids FROM rollouts WHERE num_completion_tokens = 2"
    )
    assert got.to_pylist() == [{"policy_version": 2, "completion_ids": [7, 8]}]


# -- rows with no tokens -------------------------------------------------------------------
@pytest.mark.parametrize("field", ["prompt_ids", "completion_ids"])
def test_rows_without_tokens_are_refused(store, field):
    store.append(make_rows(2))
    before = _state(store)
    change = {field: []}
    if field == "completion_ids":
        change["behavior_logprobs"] = []
    with pytest.raises(ValidationError, match=rf"row 1, field '{field}'.*at least one token"):
        store.append(_with(1, **change))
    assert _unchanged(store, before)


def _legacy_store(tmp_path) -> RolloutStore:
    """A store written before append refused token-less rows (written past validation)."""
    s = RolloutStore.open(tmp_path / "legacy", embedding_dim=8)
    rows = make_rows(6, seed=3)
    for r in rows:
        r["advantage"] = 1.0
    table = prepare(rows, s.schema)
    empty = {1: ("prompt_ids", "completion_ids"), 2: ("prompt_ids",), 4: ("completion_ids",)}
    for name, count, _src in (
        ("prompt_ids", "num_prompt_tokens", "prompt_ids"),
        ("completion_ids", "num_completion_tokens", "completion_ids"),
    ):
        values = table[name].to_pylist()
        logprobs = table["behavior_logprobs"].to_pylist()
        for i, names in empty.items():
            if name in names:
                values[i] = []
                if name == "completion_ids":
                    logprobs[i] = []
        for col, vals in ((name, values), ("behavior_logprobs", logprobs)):
            f = table.schema.field(col)
            table = table.set_column(table.schema.get_field_index(col), f, pa.array(vals, f.type))
        f = table.schema.field(count)
        lengths = pa.array([len(v) for v in values], pa.int32())
        table = table.set_column(table.schema.get_field_index(count), f, lengths)
    lance.write_dataset(table, s.dataset().uri, mode="append")
    assert s.count("num_prompt_tokens = 0 OR num_completion_tokens = 0") == 3
    return s


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize(("batch_size", "world_size"), [(1, 1), (6, 1), (3, 8), (6, 4)])
def test_loader_never_crashes_on_token_less_rows_or_empty_shards(
    tmp_path, pack, batch_size, world_size
):
    s = _legacy_store(tmp_path)
    rows = {r["rollout_id"]: r for r in s.sql("SELECT * FROM rollouts").to_pylist()}
    for rank in range(world_size):
        ds = ReplayDataset(
            s,
            ReplayConfig(seed=1),
            batch_size=batch_size,
            pack=pack,
            rank=rank,
            world_size=world_size,
            steps=4,
            record_usage=False,
            prefetch=0,
        )
        for b in ds:
            want_tokens = sum(
                len(rows[i]["prompt_ids"]) + len(rows[i]["completion_ids"])
                for i in b["rollout_ids"]
            )
            # Every completion token is scored except one with no token before it.
            want_loss = sum(
                len(rows[i]["completion_ids"])
                - (not rows[i]["prompt_ids"] and bool(rows[i]["completion_ids"]))
                for i in b["rollout_ids"]
            )
            assert b["num_tokens"] == want_tokens == int(b["attention_mask"].sum())
            assert int(b["loss_mask"].sum()) == want_loss == b["num_loss_tokens"]
            assert b["loss_mask"].shape[-1] == b["input_ids"].shape[-1] - 1
            assert (b["behavior_logprobs"] * (1 - b["loss_mask"])).abs().sum() == 0


# -- unique rollout ids ------------------------------------------------------------------
def test_duplicate_across_chunks_of_one_append_writes_nothing(store):
    a, b = make_rows(4, seed=1), make_rows(5, seed=2)
    for i, r in enumerate(a + b):
        r["rollout_id"] = f"id-{i}"
    b[3]["rollout_id"] = "id-1"
    before = _state(store)
    chunks = [pa.Table.from_pylist(a), pa.Table.from_pylist(b)]
    with pytest.raises(ValidationError, match=r"row 7, field 'rollout_id'.*'id-1'.*repeats row 1"):
        store.append(iter(chunks))
    assert _unchanged(store, before)
    # Nothing of the refused append stays on disk either.
    data = os.path.join(store.uri, "rollouts.lance", "data")
    assert not os.path.isdir(data) or os.listdir(data) == []


def test_duplicate_against_the_store_error_or_skip(store):
    rows = make_rows(6)
    for i, r in enumerate(rows):
        r["rollout_id"] = f"r{i}"
    store.append(rows[:4])
    before = _state(store)
    with pytest.raises(
        ValidationError, match=r"row 0, field 'rollout_id'.*'r2'.*already in the store"
    ):
        store.append(rows[2:])
    assert _unchanged(store, before)
    res = store.append(rows[2:], on_duplicate="skip")
    assert (res.rows, res.skipped) == (2, 2)
    ids = store.sql("SELECT rollout_id FROM rollouts ORDER BY rollout_id")["rollout_id"].to_pylist()
    assert ids == [f"r{i}" for i in range(6)]
    again = store.append(rows, on_duplicate="skip")
    assert (again.rows, again.skipped, store.version) == (0, 6, res.version)
    with pytest.raises(ValueError, match="on_duplicate"):
        store.append(rows, on_duplicate="ignore")


def test_duplicate_check_uses_the_index_and_the_unindexed_tail(store, monkeypatch):
    monkeypatch.setattr(unique, "INDEX_AFTER_ROWS", 10)
    rows = make_rows(40, seed=4)
    for i, r in enumerate(rows):
        r["rollout_id"] = f"x{i:03d}"
    for lo in range(0, 30, 10):
        store.append(rows[lo : lo + 10])
    idx = [i for i in store.dataset().describe_indices() if i.name == unique.ID_INDEX]
    assert idx, "the rollout_id index is built once enough rows lack it"
    store.append(rows[30:35])  # unindexed tail
    for old in (rows[3], rows[33]):
        with pytest.raises(ValidationError, match=rf"'{old['rollout_id']}'.*already in the store"):
            store.append([*rows[35:], old])
    assert store.count() == 35


def test_reingest_with_skip_is_a_no_op(tmp_path, capsys):
    rows = make_rows(5)
    for i, r in enumerate(rows):
        r["rollout_id"] = f"f{i}"
    f = tmp_path / "a.jsonl"
    f.write_text(_jsonl(rows))
    uri = str(tmp_path / "store")
    assert main(["ingest", "-q", uri, str(f)]) == 0
    before = _state(RolloutStore.open(uri))
    capsys.readouterr()
    assert main(["ingest", "-q", uri, str(f)]) == 2
    assert "f0" in capsys.readouterr().err and _unchanged(RolloutStore.open(uri), before)
    assert main(["ingest", "-q", "--on-duplicate", "skip", uri, str(f)]) == 0
    out = capsys.readouterr().out
    assert "0 rollouts, 5 skipped" in out and "5 skipped" in out.splitlines()[-1]
    assert _unchanged(RolloutStore.open(uri), before)


# -- every input file read to its end ----------------------------------------------------
def _zst(rows) -> bytes:
    return zstandard.ZstdCompressor().compress(_jsonl(rows).encode())


def _parquet_bytes(tmp_path, n=50) -> bytes:
    p = tmp_path / "src.parquet"
    pq.write_table(pa.Table.from_pylist(make_rows(n)), p, row_group_size=10)
    return p.read_bytes()


def _bad_files(tmp_path):
    zst = _zst(make_rows(200))
    pqb = _parquet_bytes(tmp_path)
    mid = len(pqb) // 2
    corrupt = pqb[:100] + bytes(b ^ 0xFF for b in pqb[100:mid]) + pqb[mid:]
    lines = _jsonl(make_rows(3)).encode().splitlines(keepends=True)
    lines[2] = lines[2].replace(b'"run_id": "t"', b'"run_id": "t\xc3\x28"')
    deep = _jsonl(make_rows(2)).encode().splitlines(keepends=True)
    deep_meta = dict(make_rows(1)[0], metadata="[" * 100_000 + "]" * 100_000)
    return {
        "deep.jsonl": deep[0] + b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "deepmeta.jsonl": _jsonl([deep_meta]).encode(),
        "truncated.jsonl.zst": zst[: len(zst) * 2 // 3],
        "notzstd.jsonl.zst": _jsonl(make_rows(2)).encode(),
        "empty.jsonl.zst": b"",
        "empty.parquet": b"",
        "truncated.parquet": pqb[: len(pqb) - 40],
        "headless.parquet": pqb[len(pqb) // 3 :],
        "corrupt.parquet": corrupt,
        "utf8.jsonl": b"".join(lines),
        "rows.csv": b"a,b\n1,2\n",
    }


EXPECT = {
    "deep.jsonl": r"deep.jsonl:2: JSON nested too deeply",
    "deepmeta.jsonl": r"deepmeta.jsonl:1, field 'metadata': .* too deep",
    "truncated.jsonl.zst": r"cut short",
    "notzstd.jsonl.zst": r"not zstd",
    "empty.jsonl.zst": r"empty file",
    "empty.parquet": r"Parquet",
    "truncated.parquet": r"Parquet",
    "headless.parquet": r"Parquet",
    "corrupt.parquet": r"Parquet",
    "utf8.jsonl": r"utf8.jsonl:3: .*invalid UTF-8",
    "rows.csv": r"unknown extension",
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_unreadable_file_is_refused_and_creates_nothing(tmp_path, capsys, name):
    f = tmp_path / name
    f.write_bytes(_bad_files(tmp_path)[name])
    uri = tmp_path / "new-store"
    assert main(["ingest", "-q", str(uri), str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(EXPECT[name], err), err
    assert not uri.exists()
    s = RolloutStore.open(tmp_path / "store")
    s.append(make_rows(2))
    before = _state(s)
    with pytest.raises(RolloutStoreError, match=EXPECT[name]):
        ingest_file(s, f, progress=False)
    assert _unchanged(s, before)


def test_directory_as_file_is_refused(tmp_path, capsys):
    (tmp_path / "d.jsonl").mkdir()
    good = tmp_path / "good.jsonl"
    good.write_text(_jsonl(make_rows(2)))
    uri = tmp_path / "store"
    assert main(["ingest", "-q", str(uri), str(good), str(tmp_path / "d.jsonl")]) == 2
    assert "a directory" in capsys.readouterr().err
    assert not uri.exists()  # every path is checked before anything is written
    with pytest.raises(FileUnreadableError, match="nothing at that path"):
        ingest_file(RolloutStore.open(uri), tmp_path / "missing.jsonl", progress=False)


def test_row_error_in_first_file_leaves_no_store_behind(tmp_path):
    rows = make_rows(3)
    rows[2]["behavior_logprobs"][0] = 1.0
    f = tmp_path / "a.jsonl"
    f.write_text(_jsonl(rows))
    uri = tmp_path / "store"
    assert main(["ingest", "-q", str(uri), str(f)]) == 2
    assert not uri.exists()
    uri.mkdir()  # an empty folder the user made stays, and stays empty
    assert main(["ingest", "-q", str(uri), str(f)]) == 2
    assert uri.is_dir() and list(uri.iterdir()) == []


def test_multi_frame_zstd_is_read_to_the_end(tmp_path, store):
    f = tmp_path / "two.jsonl.zst"
    f.write_bytes(_zst(make_rows(3, seed=1)) + _zst(make_rows(4, seed=2)))
    assert ingest_file(store, f, progress=False).rows == 7


# -- disk full ---------------------------------------------------------------------------
def test_disk_full_during_append_and_compact_is_a_clear_error(store, monkeypatch, tmp_path):
    store.append(make_rows(3))
    store.append(make_rows(3, seed=1))
    before = _state(store)
    real = store_mod.write_fragments

    def full(*a, **k):  # the fault only: the disk fills after the first chunk
        full.calls += 1
        if full.calls > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    full.calls = 0
    monkeypatch.setattr(store_mod, "write_fragments", full)
    with pytest.raises(DiskFullError, match="store is intact") as info:
        store.append(iter([pa.Table.from_pylist(make_rows(2, seed=5))] * 2))
    assert isinstance(info.value, OSError)
    assert _unchanged(store, before)
    monkeypatch.setattr(store_mod, "write_fragments", real)
    data = os.path.join(store.dataset().uri, "data")
    files = sorted(os.listdir(data))

    def commit_full(*a, **k):  # the disk fills while the manifest is written
        raise OSError("LanceError(IO): No space left on device (os error 28)")

    with monkeypatch.context() as m:
        m.setattr(lance.LanceDataset, "commit", staticmethod(commit_full))
        with pytest.raises(DiskFullError, match="store is intact"):
            store.append(make_rows(3, seed=6))
    assert _unchanged(store, before) and sorted(os.listdir(data)) == files

    def compact_full(self, *a, **k):
        raise OSError("LanceError(IO): No space left on device (os error 28)")

    monkeypatch.setattr(DatasetOptimizer, "compact_files", compact_full)
    with pytest.raises(DiskFullError, match="store is intact"):
        store.compact()
    assert _unchanged(store, before)
    f = tmp_path / "x.jsonl"
    f.write_text(_jsonl(make_rows(2)))
    monkeypatch.setattr(store_mod, "write_fragments", full)
    full.calls = 1
    with pytest.raises(DiskFullError):
        ingest_file(store, f, progress=False)
    assert _unchanged(store, before)


def test_ingest_error_family(tmp_path):
    assert issubclass(FileUnreadableError, IngestError)
    assert issubclass(DiskFullError, RolloutStoreError)


# -- gc: files killed appends and exports leave behind -----------------------------------
def _age(path, hours: float) -> None:
    t = time.time() - hours * 3600
    os.utime(path, (t, t))


def _killed_append(store: RolloutStore, seed: int) -> list[str]:
    """What an appender killed between writing its fragments and committing leaves."""
    table = prepare(make_rows(4, seed=seed), store.schema)
    frags = write_fragments(table, store.dataset().uri, schema=store.schema)
    return [os.path.join(store.dataset().uri, "data", f.path) for fr in frags for f in fr.files]


def _every_version(store: RolloutStore) -> dict[int, list]:
    return {
        v["version"]: sorted(
            store.checkout(v["version"]).dataset().to_table()["rollout_id"].to_pylist()
        )
        for v in store.versions()
    }


def test_gc_removes_old_orphans_and_keeps_every_version_readable(store, tmp_path):
    for i in range(3):
        store.append(make_rows(5, seed=i))
    store.evict(keep_last=7)
    store.compact()  # old versions still reference the pre-compaction files
    store.append(make_rows(2, seed=9))
    old = _killed_append(store, 20)
    young = _killed_append(store, 21)
    for p in old:
        _age(p, 2)
    exports = tmp_path / "exports"
    exports.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = exports / f".out.parquet.tmp-{int(dead.stdout)}"
    stale.write_bytes(b"partial")
    live = exports / f".other.jsonl.tmp-{os.getpid()}"
    live.write_bytes(b"in progress")
    kept = exports / "out.parquet"
    kept.write_bytes(b"done")
    for p in (stale, live, kept):
        _age(p, 2)
    before = _every_version(store)
    assert len(before) >= 6
    r = store.gc(exports=[exports])
    assert sorted(r.removed) == sorted([*old, str(stale)])
    assert r.kept_young == len(young) + 1 and r.versions_checked >= len(before)
    assert all(os.path.exists(p) for p in young) and live.exists() and kept.exists()
    assert _every_version(RolloutStore.open(store.uri, create=False)) == before
    # With no safety age the young orphan goes too; referenced files never do.
    r = store.gc(min_age=timedelta(0))
    assert sorted(r.removed) == sorted(young)
    assert _every_version(store) == before
    store.append(make_rows(1, seed=30))


def test_gc_cli_dry_run_lists_and_keeps(tmp_path, capsys):
    s = RolloutStore.open(tmp_path / "store")
    s.append(make_rows(2))
    orphans = _killed_append(s, 1)
    for p in orphans:
        _age(p, 3)
    assert main(["gc", str(s.uri), "--dry-run"]) == 0
    assert f"would remove {len(orphans)} unreferenced files" in capsys.readouterr().out
    assert all(os.path.exists(p) for p in orphans)
    assert main(["gc", str(s.uri), "--min-age-hours", "4"]) == 0
    assert all(os.path.exists(p) for p in orphans)
    assert main(["gc", str(s.uri)]) == 0
    assert not any(os.path.exists(p) for p in orphans) and s.count() == 2


# -- a torn newest manifest --------------------------------------------------------------
def _tear_newest_manifest(store: RolloutStore) -> None:
    folder = os.path.join(store.dataset().uri, "_versions")
    newest = min(n for n in os.listdir(folder) if n.endswith(".manifest"))  # V2: 2**64-1-v
    path = os.path.join(folder, newest)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_torn_manifest_opens_previous_version_read_only_until_repaired(tmp_path):
    uri = tmp_path / "store"
    s = RolloutStore.open(uri)
    for i in range(3):
        s.append(make_rows(3, seed=i))
    assert s.version == 4
    _tear_newest_manifest(s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torn = RolloutStore.open(uri, create=False)
        assert torn.count() == 6 and torn.version == 3
        torn.sql("SELECT count(*) FROM rollouts")
    assert len(caught) == 1
    assert re.search(
        r"version 4 of rollouts.lance is unreadable.*opened version 3", str(caught[0].message)
    )
    with pytest.raises(ReadOnlyError, match=r"version 3.*newest version 4 is unreadable.*repair"):
        torn.append(make_rows(1))
    with pytest.raises(ReadOnlyError):
        torn.gc()
    assert torn.repair() == 3
    assert torn.append(make_rows(1, seed=7)).version == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RolloutStore.open(uri, create=False).count() == 7


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=6),
    pack=st.booleans(),
)
def test_collate_handles_any_lengths_including_zero(lengths, pack):
    """Any rows the selector can hand over, token-less or none at all, collate without error,
    and every scorable completion token lands in the loss mask with its log-prob."""
    n = len(lengths)
    prompts = [list(range(1, p + 1)) for p, _ in lengths]
    comps = [list(range(100, 100 + c)) for _, c in lengths]
    lps = [[-(i + 1) / 10 for i in range(c)] for _, c in lengths]
    rows = pa.table(
        {
            "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
            "completion_ids": pa.array(comps, pa.list_(pa.int32())),
            "behavior_logprobs": pa.array(lps, pa.list_(pa.float32())),
        }
    )
    sel = plain_selection(n, np.full(n, 0.5))
    b = collate(rows, sel, np.arange(n), pack=pack)
    scorable = sum(c - (p == 0 and c > 0) for p, c in lengths)
    assert int(b["loss_mask"].sum()) == scorable == b["num_loss_tokens"]
    assert int(b["attention_mask"].sum()) == sum(p + c for p, c in lengths) == b["num_tokens"]
    want = sorted(x for (p, c), lp in zip(lengths, lps) for x in lp[(p == 0) :])
    got = sorted(b["behavior_logprobs"][b["loss_mask"] > 0].tolist())
    assert np.allclose(got, np.float32(want))


def test_gc_after_real_sigkilled_appenders_leaves_exactly_the_referenced_files(tmp_path):
    from pathlib import Path

    from rolloutstore.store.gc import referenced_files

    worker = Path(__file__).parents[1] / "append_worker.py"
    root = worker.parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    uri = tmp_path / "store"
    RolloutStore.open(uri)
    for k in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(worker), str(uri), f"k{k}", "10000"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline() != "", proc.stderr.read()
        time.sleep(0.05 * k)
        proc.kill()
        proc.wait()
    s = RolloutStore.open(uri, create=False)
    before = _every_version(s)
    s.gc(min_age=timedelta(0))  # no writer is left, so no age is needed
    ds = s.dataset()
    keep, _ = referenced_files(ds)
    assert set(os.listdir(os.path.join(ds.uri, "data"))) == keep
    assert _every_version(s) == before
