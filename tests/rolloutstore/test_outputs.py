"""Outputs cannot destroy the store; temp outputs never linger; terminal tables are escaped;
short batches say why; `sample --max-uses` holds across CLI calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_rows

from rolloutstore import ReplayConfig, RolloutStore, Selector
from rolloutstore.cli import main
from rolloutstore.errors import OutputPathError, ShortBatchWarning


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    s = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    s.append(make_rows(16))
    return s


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutstore", *args], capture_output=True, text=True, timeout=120
    )


def _targets(tmp_path: Path, store: RolloutStore) -> list[Path]:
    root = tmp_path / "s"
    manifest = max(
        (root / "rollouts.lance" / "_versions").iterdir(), key=lambda p: p.stat().st_mtime
    )
    link = tmp_path / "link"
    link.symlink_to(root / "rollouts.lance")
    return [
        manifest,
        root / "new.parquet",
        root,
        link / "x.parquet",
        root / "usage.lance" / "y.jsonl",
    ]


def test_export_and_sql_out_inside_a_store_are_refused(store, tmp_path):
    before = store.sql("SELECT count(*) AS n FROM rollouts")
    for target in _targets(tmp_path, store):
        p = _cli("export", store.uri, str(target), "--format", "parquet", "-q")
        assert p.returncode == 2 and "inside the" in p.stderr, (target, p.stderr)
        p = _cli("sql", store.uri, "SELECT 1 AS x", "--out", str(target), "--format", "json")
        assert p.returncode == 2 and "inside the" in p.stderr, (target, p.stderr)
    with pytest.raises(OutputPathError):
        store.export(tmp_path / "link" / "z.parquet", progress=False)
    again = RolloutStore.open(tmp_path / "s", create=False)
    assert again.sql("SELECT count(*) AS n FROM rollouts").equals(before)
    assert again.count() == 16 and not (tmp_path / "s" / "new.parquet").exists()


def test_failed_export_leaves_no_temp_file(store, tmp_path):
    out = tmp_path / "o.jsonl"
    with pytest.raises(Exception, match="Conversion|convert|Could not"):
        store.export(out, where="CAST(run_id AS INTEGER) > ?", params=[0], progress=False)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_stale_temp_files_of_dead_exports_are_removed(store, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    stale = tmp_path / f".o.parquet.tmp-{dead}"
    stale.write_bytes(b"partial")
    store.export(tmp_path / "o.parquet", progress=False)
    assert not stale.exists() and (tmp_path / "o.parquet").exists()


def test_terminal_table_escapes_control_characters_but_out_files_do_not(store, tmp_path, capsys):
    text = "\u202e red\x1b[31m bell\x07 title\x1b]0;pwned\x07"
    query = "SELECT ? AS t"
    assert main(["sql", store.uri, query, "--param", text]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "red\\x1b[31m bell\\x07" in shown and "\\u202e" in shown
    out = tmp_path / "t.txt"
    assert main(["sql", store.uri, query, "--param", text, "--out", str(out)]) == 0
    assert text in out.read_text()


def test_per_prompt_cap_shortfall_is_named(tmp_path):
    s = RolloutStore.open(tmp_path / "c", embedding_dim=8)
    rows = make_rows(40, group_size=8)  # 5 groups; every group is one prompt
    for r in rows:
        r["prompt_ids"] = [int(r["group_id"].rsplit("-", 1)[1])]
    s.append(rows)
    sel = Selector(s, ReplayConfig(per_prompt_cap=4), record_usage=False)
    with pytest.warns(
        ShortBatchWarning, match=r"drew 20 of the 32 rows.*per_prompt_cap=4.*5 prompts"
    ):
        got = sel.sample(32, 1)
    assert len(got) == 20 and got.requested == 32
    p = _cli(
        "sample", s.uri, "--learner-version", "1", "--batch-size", "32", "--per-prompt-cap", "4"
    )
    assert p.returncode == 0 and "warning: drew 20 of the 32" in p.stderr


def test_max_uses_holds_across_cli_calls(store):
    args = ["sample", store.uri, "--learner-version", "1", "--batch-size", "16", "--max-uses", "2",
            "--record-usage", "--run-id", "cli", "--format", "json"]  # fmt: skip
    drawn = []
    for _ in range(2):
        p = _cli(*args)
        assert p.returncode == 0, p.stderr
        drawn.append([json.loads(x)["rollout_id"] for x in p.stdout.splitlines()])
    assert len(drawn[0]) == len(drawn[1]) == 16  # every row used twice now
    p = _cli(*args)
    assert p.returncode == 2 and "no eligible rollouts" in p.stderr
    steps = store.sql(
        "SELECT DISTINCT learner_step AS s FROM usage WHERE run_id = 'cli' ORDER BY 1"
    )
    assert steps["s"].to_pylist() == [0, 1]
