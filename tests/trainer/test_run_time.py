"""Where a run's time goes (issue #33 item 1): sync seconds per update, eval, start-up and
checkpoint seconds in the records, and a summary that accounts for the wall time, with mu.

An accounting check, not a speed check: the measured parts may not exceed the wall time, and
must cover most of it (the rest is the loop's bookkeeping: records, progress, barriers)."""

from __future__ import annotations

import json
import tomllib

import pytest
from helpers import TINY_RUN_TOML

from trainer.config import TrainConfig
from trainer.run.loop import TIME_KEYS
from trainer.run.sync import train

RUN = (
    TINY_RUN_TOML
    + """
[loss]
entropy_coef = 0.01
[optim]
lr = 1e-3
[run]
dir = "{dir}"
steps = 4
updates_per_round = 1
batch_size = 8
checkpoint_every = 2
"""
)
PARTS = [k for k in TIME_KEYS if k != "wall_seconds"]


def config(run_dir) -> TrainConfig:
    d = tomllib.loads(RUN.format(dir=run_dir))
    d["eval"]["every"] = 2
    return TrainConfig.from_dict(d)


def records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("time") / "run"
    result = train(config(run_dir), progress=False)
    return run_dir, result


def test_every_generator_update_has_a_sync_record_with_its_seconds(run):
    run_dir, _ = run
    syncs = records(run_dir, "sync")
    first, updates = syncs[0], syncs[1:]
    assert first["first"] and first["policy_version"] == 0
    # Versions 1..4: one round per step (y = 1) and the final eval; none synced twice (the
    # eval at step 2 and the round after it share version 2).
    assert [s["policy_version"] for s in updates] == [1, 2, 3, 4]
    for s in updates:
        assert not s["first"] and s["seconds"] > 0
        assert s["gather_seconds"] + s["load_seconds"] == pytest.approx(s["seconds"])
    train_recs = records(run_dir, "train")
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    # The totals every train record carries: sync seconds are the updates' sum so far.
    last = train_recs[-1]
    assert last["sync_seconds"] == pytest.approx(sum(s["seconds"] for s in updates[:3]))
    assert all(last[k] > 0 for k in ("startup_seconds", "gen_seconds", "train_seconds"))
    evals = records(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(e["seconds"] > 0 and e["reward_se"] >= 0 for e in evals)
    assert evals[-1]["eval_seconds"] == pytest.approx(sum(e["seconds"] for e in evals), rel=0.2)


def test_the_summary_accounts_for_the_wall_time_and_gives_mu(run):
    run_dir, result = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"steps": 4, **result.timing}
    wall, parts = summary["wall_seconds"], sum(summary[k] for k in PARTS)
    assert 0.5 * wall <= parts <= wall and summary["other_seconds"] >= 0
    assert summary["other_seconds"] == pytest.approx(wall - parts)
    assert all(summary[k] > 0 for k in PARTS)
    # mu: generation seconds per rollout / learner seconds per rollout use (4 steps x 8 rows).
    assert summary["generated_rollouts"] == 4 * 6 * 4 and summary["rollout_uses"] == 32
    want = (summary["gen_seconds"] / 96) / (summary["train_seconds"] / 32)
    assert summary["mu"] == pytest.approx(want)
    assert summary["mu_with_sync"] > summary["mu"]
    (rec,) = records(run_dir, "summary")
    assert {k: rec[k] for k in result.timing} == result.timing


def test_a_resume_adds_its_time_to_the_run_s(run, capsys):
    run_dir, result = run
    before = result.timing
    more = train(config(run_dir).with_run(steps=6), resume=True, progress=False)
    after = more.timing
    assert after["wall_seconds"] > before["wall_seconds"]
    assert after["startup_seconds"] > before["startup_seconds"]
    assert after["sync_seconds"] > before["sync_seconds"]
    parts = sum(after[k] for k in PARTS)
    assert 0.5 * after["wall_seconds"] <= parts <= after["wall_seconds"]
    out = capsys.readouterr().out
    assert "time " in out and "; mu " in out and "startup" in out
