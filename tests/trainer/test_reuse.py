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
                "eval_prompts": 0,
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
