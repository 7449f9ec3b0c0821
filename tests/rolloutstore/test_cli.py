from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import make_rows

from rolloutstore import IngestError, RolloutStore
from rolloutstore.cli import main
from rolloutstore.io.ingest import ingest_file


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_ingest_jsonl_zst_and_parquet(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["init", str(store), "--embedding-dim", "8"]) == 0
    a = tmp_path / "a.jsonl"
    a.write_text(_jsonl(make_rows(5, seed=1)))
    b = tmp_path / "b.jsonl.zst"
    b.write_bytes(zstandard.ZstdCompressor().compress(_jsonl(make_rows(6, seed=2)).encode()))
    c = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(make_rows(7, seed=3)), c)
    assert main(["ingest", "-q", str(store), str(a), str(b), str(c)]) == 0
    s = RolloutStore.open(store)
    assert s.count() == 18 and s.embedding_dim == 8
    got = s.sql("SELECT completion_ids FROM rollouts WHERE run_id = 't' ORDER BY rollout_id")
    want = [
        r["completion_ids"]
        for r in make_rows(5, seed=1) + make_rows(6, seed=2) + make_rows(7, seed=3)
    ]
    assert got["completion_ids"].to_pylist() == want
    assert "ingested 18 rollouts" in capsys.readouterr().out


def test_bad_row_names_file_line_and_field_and_writes_nothing_of_that_file(tmp_path, capsys):
    s = RolloutStore.open(tmp_path / "store")
    good = tmp_path / "good.jsonl"
    good.write_text(_jsonl(make_rows(3)))
    rows = make_rows(9, seed=5)
    rows[6]["behavior_logprobs"][0] = 0.5
    bad = tmp_path / "bad.jsonl"
    text = _jsonl(rows[:4]) + "\n" + _jsonl(rows[4:])  # a blank line: line numbers shift by one
    bad.write_text(text)
    rc = main(["ingest", "-q", str(s.uri), str(good), str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{bad}:8, field 'behavior_logprobs'" in err
    assert s.count() == 3  # the good file landed, nothing of the bad one did
    broken = tmp_path / "broken.jsonl"
    broken.write_text(_jsonl(make_rows(2)) + "{oops\n")
    with pytest.raises(IngestError, match=r"broken.jsonl:3.*invalid JSON"):
        ingest_file(s, broken, progress=False)
    assert s.count() == 3


def test_ingest_map_renames_foreign_fields(tmp_path):
    s = RolloutStore.open(tmp_path / "store")
    foreign = [
        {
            "prompt_token_ids": r["prompt_ids"],
            "response_ids": r["completion_ids"],
            "old_logprobs": r["behavior_logprobs"],
            "model_version": 3,
        }
        for r in make_rows(4)
    ]
    f = tmp_path / "foreign.jsonl"
    f.write_text(_jsonl(foreign))
    rename = [
        "--map",
        "prompt_token_ids=prompt_ids",
        "--map",
        "response_ids=completion_ids",
        "--map",
        "old_logprobs=behavior_logprobs",
        "--map",
        "model_version=policy_version",
    ]
    assert main(["ingest", "-q", str(s.uri), str(f), *rename]) == 0
    assert s.sql("SELECT DISTINCT policy_version AS v FROM rollouts")["v"].to_pylist() == [3]


def test_sql_formats_and_out(tmp_path, capsys):
    s = RolloutStore.open(tmp_path / "store")
    s.append(make_rows(6, policy_version=2))
    q = "SELECT policy_version, count(*) AS n FROM rollouts WHERE reward >= ? GROUP BY 1"
    assert main(["sql", s.uri, q, "--param", "0", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"policy_version": 2, "n": 6}
    assert main(["sql", s.uri, q, "--param", "0", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"policy_version","n"', "2,6"]
    out = tmp_path / "r.parquet"
    assert (
        main(["sql", s.uri, "SELECT * FROM rollouts", "--format", "parquet", "--out", str(out)])
        == 0
    )
    assert pq.read_table(out).num_rows == 6
    assert main(["sql", s.uri, "SELECT * FROM read_csv('/etc/passwd')"]) == 2
    assert "disabled" in capsys.readouterr().err


def test_stats_versions_evict_compact(tmp_path, capsys):
    s = RolloutStore.open(tmp_path / "store")
    for v in range(3):
        s.append(make_rows(10, seed=v, policy_version=v))
    assert main(["stats", s.uri, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["rows"] == 30 and len(st["by_policy_version"]) == 3
    assert main(["stats", s.uri]) == 0
    assert "bytes/token" in capsys.readouterr().out
    assert main(["evict", s.uri, "--keep", "12"]) == 0
    assert "evicted 18 rollouts, 12 left" in capsys.readouterr().out
    assert main(["compact", s.uri]) == 0
    assert main(["versions", s.uri]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 2
    assert RolloutStore.open(s.uri).count() == 12
    assert main(["stats", str(tmp_path / "nope")]) == 2


def test_sample_prints_rows_and_sql(tmp_path, capsys):
    s = RolloutStore.open(tmp_path / "store")
    for v in range(3):
        s.append(make_rows(10, seed=v, policy_version=v))
    argv = [
        "sample",
        s.uri,
        "--batch-size",
        "4",
        "--learner-version",
        "3",
        "--max-staleness",
        "1",
        "--format",
        "json",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4 and all(r["staleness"] <= 1 and r["policy_version"] == 2 for r in rows)
    assert s.sql("SELECT count(*) AS n FROM usage")["n"][0].as_py() == 0  # inspection only
    assert main(["sample", s.uri, "--learner-version", "3", "--window", "7", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "LIMIT 7" in out and "policy_version >= 2" in out
    assert (
        main(
            ["sample", s.uri, "--batch-size", "2", "--learner-version", "9", "--max-staleness", "0"]
        )
        == 2
    )
    assert "no eligible rollouts" in capsys.readouterr().err
