"""Reuse across runs: earlier rollouts replayed with defined staleness; tokenizers must match."""

from __future__ import annotations

import json

import pytest

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.run.sources import SourceError
from trainer.run.sync import train


def _cfg(run_dir, model=None, **run):
    return TrainConfig.from_dict(
        {
            "model": {"num_layers": 1, **(model or {})},
            "task": {
                "options": {"max_operands": 2, "max_digits": 1, "ops": ["+"]},
            },
            "generation": {"group_size": 4, "max_tokens": 5, "prompts_per_round": 4},
            "replay": {"window": 1024},
            "run": {
                "dir": str(run_dir),
                "batch_size": 16,
                "updates_per_round": 2,
                "checkpoint_every": 2,
                "warm_start_steps": 1,
                **run,
            },
            "eval": {"prompts": 0},
        }
    )


@pytest.mark.slow
def test_earlier_runs_are_replayed_with_lineage_and_tokenizer_check(tmp_path):
    a = train(_cfg(tmp_path / "a", steps=4), progress=False)
    src = RolloutStore.open(a.store, create=False)
    newest = src.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py()
    n_src = src.count()

    b = train(_cfg(tmp_path / "b", steps=2, sources=[str(tmp_path / "a")]), progress=False)
    store = RolloutStore.open(b.store, create=False)
    got = store.sql(
        "SELECT run_id, min(policy_version) AS lo, max(policy_version) AS hi, count(*) AS n "
        "FROM rollouts GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    assert got[0] == {"run_id": "a", "lo": -1 - newest, "hi": -1, "n": n_src}
    assert got[1]["run_id"] == "b" and got[1]["lo"] == 0
    lineage = store.sql("SELECT run_id, policy_version, parent_run, parent_version FROM lineage")
    assert lineage.to_pylist() == [
        {"run_id": "b", "policy_version": 0, "parent_run": "a", "parent_version": newest}
    ]
    # The behaviour log-probs travel unchanged, so the importance correction stays valid.
    same = store.sql("SELECT count(*) AS n FROM rollouts WHERE run_id = 'a'")["n"][0].as_py()
    assert same == n_src
    steps = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    shares = [s["from_earlier_runs"] for s in steps if s["kind"] == "train"]
    assert len(shares) == 2 and max(shares) > 0

    # Resuming (or re-running the import) never copies a run twice.
    from trainer.run.sources import import_sources

    assert (
        import_sources(
            store,
            [str(tmp_path / "a")],
            run_id="b",
            fingerprint=src.sql("SELECT any_value(tokenizer_fingerprint) AS f FROM rollouts")["f"][
                0
            ].as_py(),
        )
        == []
    )

    with pytest.raises(SourceError, match="same tokenizer"):
        train(
            _cfg(tmp_path / "c", steps=1, sources=[str(tmp_path / "a")], model={"vocab_size": 480}),
            progress=False,
        )


@pytest.mark.slow
def test_chained_sources_keep_version_order_and_lineage_and_report_usable_rows(tmp_path, capsys):
    # a -> b (replays a) -> c (replays b, which holds a's rows rebased onto b's versions).
    train(_cfg(tmp_path / "a", steps=2), progress=False)
    train(_cfg(tmp_path / "b", steps=2, sources=[str(tmp_path / "a")]), progress=False)
    b = RolloutStore.open(tmp_path / "b" / "store", create=False)
    nb = b.sql("SELECT max(policy_version) AS v FROM rollouts WHERE run_id = 'b'")["v"][0].as_py()
    (link_ba,) = b.sql("SELECT * FROM lineage").to_pylist()
    capsys.readouterr()

    cfg = _cfg(tmp_path / "c", steps=2, sources=[str(tmp_path / "b")])
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "replay": {"window": 1024, "max_staleness": 1}})
    train(cfg, progress=False)
    store = RolloutStore.open(tmp_path / "c" / "store", create=False)
    got = {
        r["run_id"]: (r["lo"], r["hi"])
        for r in store.sql(
            "SELECT run_id, min(policy_version) AS lo, max(policy_version) AS hi FROM rollouts "
            "GROUP BY 1"
        ).to_pylist()
    }
    # b's rows end just before c's version 0; a's rows stay older than all of b's.
    assert got["b"][1] == -1 and got["b"][0] == -1 - nb
    assert got["a"][1] < got["b"][0]
    lineage = store.sql("SELECT run_id, policy_version, parent_run, parent_version FROM lineage")
    assert sorted(lineage.to_pylist(), key=lambda r: r["run_id"]) == [
        {
            "run_id": "b",
            "policy_version": 0,
            "parent_run": "a",
            "parent_version": link_ba["parent_version"],
        },
        {"run_id": "c", "policy_version": 0, "parent_run": "b", "parent_version": nb},
    ]

    # The start says how many imported rows max_staleness = 1 leaves usable (b's, not a's)
    # and until when.
    imported = store.sql(
        "SELECT count(*) AS n, count(*) FILTER (WHERE policy_version >= -1) AS usable "
        "FROM rollouts WHERE run_id <> 'c'"
    ).to_pylist()[0]
    assert 0 < imported["usable"] < imported["n"]
    records = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    (rep,) = [r for r in records if r["kind"] == "sources"]
    assert (rep["rows"], rep["usable"], rep["last_usable_step"]) == (
        imported["n"],
        imported["usable"],
        1,
    )
    out = capsys.readouterr().out
    assert f"sources: {imported['usable']} of {imported['n']} imported rows are usable" in out
    assert "age out after learner step 1" in out
