"""Export: formats, shapes (rollouts / sft / dpo), the --where sandbox, and lossless round trips."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import UTC, datetime

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.cli import main
from rolloutstore.errors import EmptyExportError, QueryError, RolloutStoreError
from rolloutstore.io import export as export_mod
from rolloutstore.io.export import (
    DPO_COLUMNS,
    SFT_COLUMNS,
    ExportError,
    ExportResult,
    MissingDependencyError,
    check_where,
)
from rolloutstore.io.ingest import ingest_file

EMB = 4
SUFFIX = {"parquet": "parquet", "jsonl": "jsonl", "jsonl.zst": "jsonl.zst"}


def _rows_sorted(store: RolloutStore) -> pa.Table:
    # As every read shows them (an all-ones loss mask is stored null, read as the ones).
    return store.take(list(range(store.count()))).sort_by("rollout_id")


def _row(prompt: list[int], reward: float | None, group: str, rid: str, text: str = "x") -> dict:
    return {
        "rollout_id": rid,
        "group_id": group,
        "policy_version": 0,
        "prompt_ids": prompt,
        "prompt_text": f"p{prompt}",
        "completion_ids": [len(rid)],
        "completion_text": text,
        "behavior_logprobs": [-0.5],
        "reward": reward,
    }


@pytest.fixture
def scored(tmp_path) -> RolloutStore:
    """Hand-made groups whose SFT and DPO outputs are known exactly."""
    s = RolloutStore.open(tmp_path / "scored", embedding_dim=EMB)
    s.append(
        [
            # prompt A, group a1: a tie at the top, one loser
            _row([1], 1.0, "a1", "a1-hi1"),
            _row([1], 1.0, "a1", "a1-hi0"),
            _row([1], 0.0, "a1", "a1-lo"),
            # prompt A, group a2: margin 0.2 only
            _row([1], 0.7, "a2", "a2-hi"),
            _row([1], 0.5, "a2", "a2-lo"),
            # prompt B: best is 0.5
            _row([2], 0.2, "b1", "b1-lo"),
            _row([2], 0.5, "b1", "b1-hi"),
            # prompt C: unscored, and a single-row group
            _row([3], None, "c1", "c1-a"),
            _row([4], 1.0, "d1", "d1-only"),
        ]
    )
    return s


# -- rollouts in every format -------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.zst"])
def test_rollouts_export_ingests_back(tmp_path, fmt):
    src = RolloutStore.open(tmp_path / "src", embedding_dim=EMB)
    rows = make_rows(30, seed=3)
    for i, r in enumerate(rows):
        r["embedding"] = [float(i), -1.5, 0.25, 1e-30]
        r["tags"] = ["a", f"t{i}"] if i % 2 else None
        r["reward_info"] = json.dumps({"score": i, "note": "ü\n"})
    src.append(rows)
    out = tmp_path / f"out.{SUFFIX[fmt]}"
    res = src.export(out, format=fmt, progress=False)
    assert res == ExportResult(30, str(out))
    dst = RolloutStore.open(tmp_path / "dst", embedding_dim=EMB)
    assert ingest_file(dst, out, progress=False).rows == 30
    assert _rows_sorted(dst).equals(_rows_sorted(src))


def test_parquet_is_zstd_and_written_batch_by_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(export_mod, "BATCH_ROWS", 7)
    s = RolloutStore.open(tmp_path / "s", embedding_dim=EMB)
    s.append(make_rows(30))
    out = tmp_path / "o.parquet"
    s.export(out, progress=False)
    meta = pq.ParquetFile(out).metadata
    assert meta.num_rows == 30
    assert meta.num_row_groups == 5  # one row group per streamed batch of 7
    assert meta.row_group(0).column(0).compression == "ZSTD"


def test_parquet_opens_in_every_reader(tmp_path):
    s = RolloutStore.open(tmp_path / "s", embedding_dim=EMB)
    s.append(make_rows(12))
    out = tmp_path / "o.parquet"
    s.export(out, progress=False)
    want = _rows_sorted(s)

    got_pa = pq.read_table(out).sort_by("rollout_id")
    assert got_pa.equals(want)

    got_db = (
        duckdb.connect()
        .execute("SELECT rollout_id, completion_ids FROM read_parquet(?) ORDER BY 1", [str(out)])
        .fetchall()
    )
    assert got_db == list(zip(want["rollout_id"].to_pylist(), want["completion_ids"].to_pylist()))

    import polars as pl

    got_pl = pl.read_parquet(out).sort("rollout_id")
    assert got_pl["behavior_logprobs"].to_list() == want["behavior_logprobs"].to_pylist()
    assert got_pl.height == 12

    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf-cache")
    )
    assert ds.num_rows == 12
    assert sorted(ds["rollout_id"]) == want["rollout_id"].to_pylist()
    assert set(ds.column_names) == set(want.column_names)


def test_hf_format_loads_from_disk(tmp_path, scored):
    import datasets

    out = tmp_path / "dpo_hf"
    res = scored.export(out, format="hf", as_="dpo", min_margin=0.25, progress=False)
    ds = datasets.load_from_disk(str(out))
    assert res.rows == ds.num_rows == 2
    assert ds.column_names == list(DPO_COLUMNS)
    assert ds["chosen_reward"] == [1.0, 0.5]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp files left


def test_hf_refuses_non_empty_folder(tmp_path, scored):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        scored.export(out, format="hf", progress=False)
    assert (out / "keep.txt").read_text() == "mine"


def test_hf_without_datasets_names_the_extra(tmp_path, scored, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDependencyError, match=r"rolloutstore\[dev\]") as exc:
        scored.export(tmp_path / "hf", format="hf", progress=False)
    assert isinstance(exc.value, ImportError)
    assert not (tmp_path / "hf").exists()


def test_columns_subset_in_given_order(tmp_path, scored):
    out = tmp_path / "o.jsonl"
    scored.export(out, columns=["reward", "rollout_id"], where="reward IS NOT NULL", progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(r) for r in rows] == [["reward", "rollout_id"]] * 8
    assert {r["rollout_id"] for r in rows} == {
        "a1-hi1", "a1-hi0", "a1-lo", "a2-hi", "a2-lo", "b1-lo", "b1-hi", "d1-only",
    }  # fmt: skip


# -- sft / dpo ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("min_reward", "keep_duplicates", "expected"),
    [
        # ties at the per-prompt max kept; a1-hi0 and a1-hi1 are the same (prompt, completion)
        (None, True, ["a1-hi0", "a1-hi1", "b1-hi", "d1-only"]),
        (None, False, ["a1-hi0", "b1-hi", "d1-only"]),  # each pair once: the smallest id
        (0.5, True, ["a1-hi0", "a1-hi1", "a2-hi", "a2-lo", "b1-hi", "d1-only"]),
        (0.5, False, ["a1-hi0", "a2-hi", "b1-hi", "d1-only"]),  # a2-lo repeats a2-hi (0.7)
    ],
)
def test_sft(tmp_path, scored, min_reward, keep_duplicates, expected):
    out = tmp_path / "sft.parquet"
    res = scored.export(
        out, as_="sft", min_reward=min_reward, keep_duplicates=keep_duplicates, progress=False
    )
    t = pq.read_table(out)
    assert t.column_names == list(SFT_COLUMNS)
    assert res.rows == t.num_rows == len(expected)
    assert sorted(t["rollout_id"].to_pylist()) == expected
    assert t.schema.field("completion_ids").type == pa.list_(pa.int32())
    assert t["prompt"][0].as_py().startswith("p[")


def test_sft_default_drops_prompts_whose_best_reward_is_zero(tmp_path):
    s = RolloutStore.open(tmp_path / "s", embedding_dim=EMB)
    rows = [
        _row([1], 0.0, "z1", "z-lo0", "a"),
        _row([1], 0.0, "z1", "z-lo1", "b"),  # prompt [1]: best 0, no demonstration
        _row([2], 1.0, "w1", "w-hi", "c"),
        _row([2], 0.0, "w1", "w-lo", "d"),
    ]
    for i, r in enumerate(rows):
        r["completion_ids"] = [i]  # four distinct completions
    s.append(rows)
    s.export(tmp_path / "sft.parquet", as_="sft", progress=False)
    assert pq.read_table(tmp_path / "sft.parquet")["rollout_id"].to_pylist() == ["w-hi"]
    s.export(tmp_path / "all.parquet", as_="sft", min_reward=0.0, progress=False)
    assert pq.read_table(tmp_path / "all.parquet").num_rows == 4


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"as_": "sft", "min_reward": 2.0}, "no completion has reward >= --min-reward 2"),
        ({"as_": "sft", "where": "reward < ?", "params": [0.1]}, "best reward of the 1 scored"),
        ({"as_": "dpo", "min_margin": 1.5}, "under --min-margin 1.5"),
        ({"as_": "rollouts", "where": "reward > ?", "params": [5]}, "no row matches --where"),
    ],
)
def test_empty_export_is_refused_with_the_reason_and_writes_nothing(
    tmp_path, scored, kwargs, reason, capsys
):
    out = tmp_path / "o.jsonl"
    with pytest.raises(EmptyExportError, match=re.escape(reason)):
        scored.export(out, progress=False, **kwargs)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    args = ["export", scored.uri, str(out), "-q", "--as", kwargs["as_"]]
    if "min_reward" in kwargs:
        args += ["--min-reward", str(kwargs["min_reward"])]
    if "min_margin" in kwargs:
        args += ["--min-margin", str(kwargs["min_margin"])]
    if "where" in kwargs:
        args += ["--where", kwargs["where"], "--param", str(kwargs["params"][0])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: nothing to export") and reason in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("min_margin", "pairs"),
    [
        (None, [("a1", "a1-hi0", "a1-lo")]),  # b1 margin 0.3 and a2 margin 0.2 are under 0.5
        (0.25, [("a1", "a1-hi0", "a1-lo"), ("b1", "b1-hi", "b1-lo")]),
        (0.0, [("a1", "a1-hi0", "a1-lo"), ("a2", "a2-hi", "a2-lo"), ("b1", "b1-hi", "b1-lo")]),
    ],
)
def test_dpo_best_vs_worst_per_group(tmp_path, scored, min_margin, pairs):
    out = tmp_path / "dpo.jsonl"
    res = scored.export(out, format="jsonl", as_="dpo", min_margin=min_margin, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert res.rows == len(rows) == len(pairs)
    assert all(list(r) == list(DPO_COLUMNS) for r in rows)
    by_id = {r["rollout_id"]: r for r in scored.dataset().to_table().to_pylist()}
    for r, (group, chosen, rejected) in zip(rows, pairs):  # sorted by group_id
        assert r["group_id"] == group
        assert r["chosen_ids"] == by_id[chosen]["completion_ids"]
        assert r["rejected_ids"] == by_id[rejected]["completion_ids"]
        assert r["chosen_reward"] == by_id[chosen]["reward"]
        assert r["rejected_reward"] == by_id[rejected]["reward"]
        assert (
            r["chosen_reward"] - r["rejected_reward"]
            >= (0.5 if min_margin is None else min_margin) - 1e-6
        )
        assert r["prompt_ids"] == by_id[chosen]["prompt_ids"]


def test_where_filters_before_shaping(tmp_path, scored):
    out = tmp_path / "sft.parquet"
    scored.export(out, as_="sft", where="rollout_id <> ? AND rollout_id <> ?",
                  params=["a1-hi0", "a1-hi1"], progress=False)  # fmt: skip
    # with A's two 1.0s filtered out, A's best is a2-hi (0.7)
    assert sorted(pq.read_table(out)["rollout_id"].to_pylist()) == ["a2-hi", "b1-hi", "d1-only"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"columns": ["nope"]}, "unknown column"),
        ({"as_": "dpo", "columns": ["completion_ids"]}, "unknown column"),
        ({"as_": "dpo", "min_reward": 1.0}, "sft only"),
        ({"as_": "sft", "min_margin": 1.0}, "dpo only"),
        ({"as_": "dpo", "min_margin": -1.0}, ">= 0"),
        ({"as_": "sft", "min_reward": float("nan")}, "finite"),
        ({"format": "csv"}, "unknown format"),
        ({"as_": "kto"}, "unknown --as"),
    ],
)
def test_bad_options(tmp_path, scored, kwargs, match):
    with pytest.raises(ExportError, match=match):
        scored.export(tmp_path / "o.parquet", progress=False, **kwargs)
    assert not (tmp_path / "o.parquet").exists()


# -- the --where sandbox ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "where",
    [
        "1=1) UNION SELECT * FROM rollouts WHERE (1=1",
        "1=1) UNION ALL SELECT * FROM usage --",
        "true; DROP TABLE rollouts",
        "true -- trailing comment",
        "true /* comment */",
        "1=1) ORDER BY (1",
        "'(' ) UNION SELECT * FROM rollouts WHERE ('x' = 'x'",
        # parens hidden in dollar quotes balance for a naive scan; DuckDB's parser catches it
        "$$($$) UNION SELECT 1 FROM rollouts WHERE (1=1 OR $$)$$ = ''",
        "reward > (",
        "",
    ],
)
def test_where_refuses_non_filters(tmp_path, scored, where):
    out = tmp_path / "o.parquet"
    with pytest.raises(QueryError):
        scored.export(out, where=where, progress=False)
    assert not out.exists()


@pytest.mark.parametrize(
    "where",
    [
        "EXISTS (SELECT * FROM read_text('/etc/passwd'))",
        "rollout_id IN (SELECT * FROM read_csv('/etc/hostname'))",
        "length(getenv('HOME')) > 0",
    ],
)
def test_where_cannot_read_files(tmp_path, scored, where):
    out = tmp_path / "o.jsonl"
    with pytest.raises(QueryError):
        scored.export(out, format="jsonl", where=where, progress=False)
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_where_with_param_and_quoted_parens(tmp_path, scored):
    assert check_where(" reward > ? AND completion_text <> ')(' ") == (
        "reward > ? AND completion_text <> ')('"
    )
    out = tmp_path / "o.parquet"
    res = scored.export(out, where="reward >= ? AND prompt_ids[1] = ?", params=[0.6, 1],
                        progress=False)  # fmt: skip
    assert res.rows == 3
    assert sorted(pq.read_table(out)["rollout_id"].to_pylist()) == ["a1-hi0", "a1-hi1", "a2-hi"]


def test_params_without_where_refused(tmp_path, scored):
    with pytest.raises(QueryError, match="no --where"):
        scored.export(tmp_path / "o.parquet", params=[1], progress=False)


# -- CLI -------------------------------------------------------------------------------------
def test_cli_export(tmp_path, scored, capsys):
    out = tmp_path / "sft.jsonl.zst"
    rc = main(["export", scored.uri, str(out), "--as", "sft", "--min-reward", "0.6",
               "--where", "reward < ?", "--param", "1", "-q"])  # fmt: skip
    assert rc == 0
    assert "exported 1 rows (sft, jsonl.zst)" in capsys.readouterr().out
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(out.open("rb")) as f:
        rows = [json.loads(x) for x in f.read().decode().splitlines()]
    assert [r["rollout_id"] for r in rows] == ["a2-hi"]

    out2 = tmp_path / "cols.parquet"
    rc = main(["export", scored.uri, str(out2), "--columns", "rollout_id,reward", "-q"])
    assert rc == 0
    assert pq.read_table(out2).column_names == ["rollout_id", "reward"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--where", "1=1) UNION SELECT * FROM rollouts WHERE (1=1"], "single filter"),
        (["--as", "dpo", "--min-reward", "1"], "sft only"),
    ],
)
def test_cli_export_errors(tmp_path, scored, capsys, args, message):
    rc = main(["export", scored.uri, str(tmp_path / "o.parquet"), "-q", *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_needs_format_for_unknown_extension(tmp_path, scored, capsys):
    assert main(["export", scored.uri, str(tmp_path / "o.bin"), "-q"]) == 2
    assert "--format" in capsys.readouterr().err
    assert main(["export", scored.uri, str(tmp_path / "o.bin"), "--format", "jsonl", "-q"]) == 0
    assert len((tmp_path / "o.bin").read_text().splitlines()) == 9


def test_errors_are_rolloutstore_errors():
    assert issubclass(ExportError, RolloutStoreError) and issubclass(ExportError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)


# -- lossless round trip ---------------------------------------------------------------------
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
texts = st.text(max_size=8)


@st.composite
def rollout(draw, i: int) -> dict:
    c = draw(st.integers(1, 5))
    row = {
        "rollout_id": f"r{i:03d}",
        "group_id": draw(st.sampled_from(["g0", "g1"])),
        "sample_index": i,
        "policy_version": draw(st.integers(0, 2**62)),
        "prompt_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)),
        "completion_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=c, max_size=c)),
        "behavior_logprobs": draw(
            st.lists(
                st.floats(max_value=0.0, width=32, allow_infinity=False), min_size=c, max_size=c
            )  # fmt: skip
        ),
        "reward": draw(st.none() | f32),
        "advantage": draw(st.none() | f32),
        "prompt_text": draw(st.none() | texts),
        "reward_info": draw(
            st.none() | st.dictionaries(texts, st.integers() | texts, max_size=3).map(json.dumps)
        ),
        "embedding": draw(st.none() | st.lists(f32, min_size=EMB, max_size=EMB)),
        "tags": draw(st.none() | st.lists(texts, max_size=3)),
        "created_at": draw(
            st.none()
            | st.datetimes(datetime(1971, 1, 1), datetime(2100, 1, 1)).map(
                lambda d: d.replace(tzinfo=UTC)
            )
        ),
        "seed": draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
    }
    return row


@st.composite
def rollouts(draw) -> list[dict]:
    n = draw(st.integers(1, 4))
    return [draw(rollout(i)) for i in range(n)]


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=rollouts())
def test_round_trip_is_lossless(tmp_path_factory, rows):
    base = tmp_path_factory.mktemp("rt")
    src = RolloutStore.open(base / "src", embedding_dim=EMB)
    src.append(rows)
    want = _rows_sorted(src)
    for fmt in ("parquet", "jsonl", "jsonl.zst"):
        out = base / f"out.{SUFFIX[fmt]}"
        assert src.export(out, format=fmt, progress=False).rows == len(rows)
        dst = RolloutStore.open(base / f"dst-{fmt}", embedding_dim=EMB)
        ingest_file(dst, out, progress=False)
        got = _rows_sorted(dst)
        assert got.column_names == want.column_names
        for name in want.column_names:
            assert got[name].to_pylist() == want[name].to_pylist(), (fmt, name)
        for name in ("behavior_logprobs", "embedding"):  # bit-exact, -0.0 included
            a = pa.chunked_array(want[name]).combine_chunks().flatten().to_numpy(False)
            b = pa.chunked_array(got[name]).combine_chunks().flatten().to_numpy(False)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (fmt, name)


def test_format_follows_extension_and_mismatch_is_refused(tmp_path, scored):
    out = tmp_path / "o.jsonl"
    assert scored.export(out, progress=False).rows == 9
    assert len([json.loads(x) for x in out.read_text().splitlines()]) == 9
    with pytest.raises(ExportError, match="names a jsonl file"):
        scored.export(tmp_path / "p.jsonl", format="parquet", progress=False)
    assert not (tmp_path / "p.jsonl").exists()


def test_progress_bar_counts_rows(tmp_path, scored, monkeypatch):
    import tqdm.auto

    bars = []

    class Recorder(tqdm.auto.tqdm):
        def close(self):
            bars.append((self.desc, self.n, self.total, self.disable))
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    scored.export(tmp_path / "o.parquet", as_="sft", keep_duplicates=True, progress=True)
    assert bars[0] == ("export sft", 4, 4, False)  # tqdm may close twice
