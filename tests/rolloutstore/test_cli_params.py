"""One ``--param`` flag for every command's ``--where`` (``sample``'s ``--where-params`` kept as
a deprecated alias), store commands given a training run's folder, and the ``usage`` view's
documented columns."""

from __future__ import annotations

import json

import pytest
from helpers import make_rows

from rolloutstore import RolloutStore
from rolloutstore.cli import main


@pytest.fixture
def run_dir(tmp_path):
    """A run folder as rolloutstore-train leaves it: RUN/store plus other files."""
    run = tmp_path / "run"
    store = RolloutStore.open(run / "store", embedding_dim=4)
    store.append(make_rows(16, seed=1, policy_version=3))
    (run / "metrics.jsonl").write_text("")
    return run


def _ids(out: str) -> list[str]:
    return [json.loads(line)["rollout_id"] for line in out.splitlines()]


def test_sample_takes_param_like_sql_and_export(run_dir, capsys):
    store = str(run_dir / "store")
    base = ["sample", store, "--batch-size", "16", "--learner-version", "3", "--format", "json"]
    assert main([*base, "--where", "reward > ? AND num_completion_tokens > ?", "--param", "0.5",
                 "--param", "5"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    got = (
        RolloutStore.open(store)
        .sql("SELECT rollout_id, reward, num_completion_tokens FROM rollouts")
        .to_pylist()
    )
    want = {r["rollout_id"] for r in got if r["reward"] > 0.5 and r["num_completion_tokens"] > 5}
    assert want and set(_ids(out)) == want and "deprecated" not in err
    # The old flag still works, with a one-line deprecation warning.
    assert main([*base, "--where", "reward > ?", "--where-params", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert set(_ids(out)) == {r["rollout_id"] for r in got if r["reward"] > 0.5}
    assert "--where-params is deprecated" in err and "--param" in err
    assert main([*base, "--where", "reward > ?", "--where-params", "0.5", "--param", "1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_store_commands_accept_a_run_folder(run_dir, capsys):
    run = str(run_dir)
    assert main(["sql", run, "SELECT count(*) AS n FROM rollouts", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"n": 16}
    assert err.strip().splitlines() == [f"{run} is a run folder: using its store {run}/store"]
    assert main(["stats", run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 16
    assert main(["export", run, str(run_dir.parent / "o.jsonl"), "-q"]) == 0
    assert "exported 16 rows" in capsys.readouterr().out
    assert main(["sample", run, "--batch-size", "4", "--learner-version", "3"]) == 0
    # A folder that is neither a store nor holds one is still refused as before.
    assert main(["stats", str(run_dir.parent)]) == 2


def test_usage_columns_as_documented(run_dir, capsys):
    store = str(run_dir / "store")
    assert main(["sample", store, "--batch-size", "4", "--learner-version", "3",
                 "--record-usage", "--learner-step", "7"]) == 0  # fmt: skip
    capsys.readouterr()
    # `at` is a DuckDB reserved word: docs/cli.md says to quote it.
    q = 'SELECT learner_step, run_id, "at" IS NOT NULL AS timed FROM usage'
    assert main(["sql", store, q, "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"learner_step": 7, "run_id": "default", "timed": True}] * 4
