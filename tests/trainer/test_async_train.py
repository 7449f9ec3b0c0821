"""Async mode: actors and a learner sharing only the store and the weights folder.

A run with two actors completes with bounded staleness and unique ids, and resumes
from its newest checkpoint; an actor SIGKILLed mid-round is restarted and no rollout
is lost, duplicated or half-written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.run.actor import actor_seed
from trainer.run.async_learner import rounds_ahead
from trainer.run.faults import ACTOR_FAULT_ENV as FAULT_ENV

ROOT = Path(__file__).parents[2]
MAX_STALENESS = 2
GROUP, PROMPTS, BATCH = 4, 6, 8
SMALL = f"""
[model]
num_layers = 1
hidden_size = 128
[task]
name = "arith"
options = {{{{ max_operands = 2, max_digits = 1, ops = ["+"] }}}}
[generation]
backend = "hf"
group_size = {GROUP}
max_tokens = 5
prompts_per_round = {PROMPTS}
batch_prompts = 3
[replay]
window = 64
max_staleness = {MAX_STALENESS}
seed = 1
[optim]
lr = 1e-3
[run]
dir = "{{dir}}"
run_id = "async-test"
id_time_ms = 1700000000000
mode = "async"
steps = {{steps}}
batch_size = {BATCH}
min_rows = 16
checkpoint_every = 3
warm_start_steps = 2
[eval]
prompts = 4
every = 0
"""


def _train(tmp_path: Path, *, steps: int = 6, fault: str | None = None) -> Path:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(SMALL.format(dir=tmp_path / "run", steps=steps))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "train", str(cfg), "--actors", "2", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return tmp_path / "run"


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _rows(run: Path) -> list[dict]:
    store = RolloutStore.open(run / "store", create=False)
    return store.sql("SELECT rollout_id, group_id, policy_version FROM rollouts").to_pylist()


def _round_sizes(rows: list[dict]) -> Counter:
    """Rows per (actor, round) namespace: group ids are RUN/aK/rR/bB/gJ."""
    return Counter("/".join(r["group_id"].split("/")[1:3]) for r in rows)


def test_seeds_and_rounds_ahead():
    seeds = {actor_seed(0, k, r) for k in range(4) for r in range(50)}
    assert len(seeds) == 200  # distinct prompts per (actor, round)
    assert actor_seed(0, 1, 7) == actor_seed(0, 1, 7)  # stable across restarts
    cfg = TrainConfig.from_dict({"run": {"actors": 1, "min_rows": 100}})
    per_round = cfg.generation.prompts_per_round * cfg.generation.group_size
    # One version must be able to fill min_rows, else learner and actors wait on each other.
    assert rounds_ahead(cfg) * per_round >= 100
    assert rounds_ahead(cfg.with_run(min_rows=1)) == 2


def test_async_run_with_two_actors(tmp_path):
    run = _train(tmp_path)
    rows = _rows(run)
    ids = [r["rollout_id"] for r in rows]
    assert len(ids) == len(set(ids))
    rounds = _round_sizes(rows)
    assert {ns.split("/")[0] for ns in rounds} == {"a0", "a1"}  # both actors wrote
    assert set(rounds.values()) == {PROMPTS * GROUP}  # every round complete
    assert len({r["policy_version"] for r in rows}) >= 3  # actors picked up new weights

    train = _records(run, "train")
    assert [r["step"] for r in train] == list(range(1, 7))
    for r in train:
        assert 0 <= r["staleness_max"] <= MAX_STALENESS, r
        assert all(int(k) <= MAX_STALENESS for k in r["staleness_hist"])
        assert r["learner_version"] == r["step"] - 1
    gens = _records(run, "generate")
    assert {g["actor"] for g in gens} == {0, 1}
    # Generation totals are logged with each step (the reward-vs-tokens plot reads them):
    # never more than the store held, never decreasing, and the realised replay ratio.
    tokens = [r["generated_tokens"] for r in train]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert train[-1]["generated_rollouts"] <= len(rows)
    for r in train:
        assert r["replay_ratio"] == r["step"] * BATCH / r["generated_rollouts"]
    assert (run / "checkpoints" / "step-000000006").is_dir()
    assert (run / "weights" / "LATEST").read_text().strip() == "6"
    assert (run / "STOP").exists()

    # Resume continues from the newest checkpoint (policy version 6), not from scratch.
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "resume", str(run), "--set", "run.steps=7", "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    train = _records(run, "train")
    assert [r["step"] for r in train] == list(range(1, 8))
    assert train[-1]["learner_version"] == 6
    assert (run / "checkpoints" / "step-000000007").is_dir()
    ids = [r["rollout_id"] for r in _rows(run)]
    assert len(ids) == len(set(ids))


def test_crashed_actor_is_restarted_without_loss_or_duplicates(tmp_path):
    # 10 steps, not 6: actor 0 dies in its round 1; the learner must still be running to see
    # it (a loaded machine let 6 steps finish on actor 1's rows before the death was noticed)
    run = _train(tmp_path, fault="0:1", steps=10)
    restarts = _records(run, "actor_restart")
    assert restarts and restarts[0]["actor"] == 0
    assert restarts[0]["returncode"] == -signal.SIGKILL
    assert len(restarts) == 1  # the fault hit only the first life
    log = (run / "actors" / "a0.log").read_text()
    assert "starting at round 1 (left unfinished by an earlier life)" in log

    rows = _rows(run)
    ids = [r["rollout_id"] for r in rows]
    assert len(ids) == len(set(ids))
    groups = Counter(r["group_id"] for r in rows)
    assert set(groups.values()) == {GROUP}  # no partial groups
    rounds = _round_sizes(rows)
    assert rounds["a0/r1"] == PROMPTS * GROUP  # the killed round was finished, once
    assert set(rounds.values()) == {PROMPTS * GROUP}
    assert len(_records(run, "train")) == 10


def test_weights_pruned_while_an_actor_loads_them_read_as_pruned(tmp_path):
    """A slow actor may read LATEST and find the folder half pruned by a newer publish when it
    builds its generator: that must be FileNotFoundError (read LATEST again), not a crash."""
    import shutil

    from trainer.models.load import load_model
    from trainer.models.tiny import make_tiny_model
    from trainer.rollout.policy import HFPolicy as _HFPolicy
    from trainer.rollout.weights import publish_weights

    make_tiny_model(tmp_path / "init", num_layers=1, hidden_size=128)
    model, _ = load_model(tmp_path / "init")
    folder = publish_weights(tmp_path / "weights", 0, model, template=tmp_path / "init")
    for f in folder.iterdir():  # what a prune leaves mid-way: the weights, nothing else
        if f.name != "model.safetensors":
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    with pytest.raises(FileNotFoundError, match="pruned"):
        _HFPolicy("r").load(0, folder)
    folder = publish_weights(tmp_path / "weights", 1, model, template=tmp_path / "init")
    assert _HFPolicy("r").load(1, folder).policy_version == 1  # a whole folder still loads
