"""The Ray launcher ([run] launcher = "ray") on one machine: a ray.cluster_utils.Cluster
shared by the module (a head with 2 CPUs, started once; each test's learner joins it).

An async run trains and resumes with Ray actors; an actor killed by the injected fault is
restarted by Ray and every row lands once; a node removed mid-run (its actor restarted by
Ray on another node) loses and duplicates nothing; and the default path never imports Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.run.faults import ACTOR_FAULT_ENV

ray = pytest.importorskip("ray", reason="the Ray tests need the dev extras (ray)")
from ray.cluster_utils import Cluster  # noqa: E402

ROOT = Path(__file__).parents[2]
GROUP, PROMPTS = 4, 6
STEPS_ACROSS_NODES, PAUSE_AT = 12, 3


@pytest.fixture(scope="module")
def cluster():
    """One Ray cluster for the module: a head node with 2 CPUs, this process its driver."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _config(tmp_path: Path, *, steps: int, **ray_table) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": {"num_layers": 1, "hidden_size": 128},
            "task": {"name": "arith", "options": {"max_operands": 2, "max_digits": 1}},
            "generation": {
                "backend": "hf", "group_size": GROUP, "max_tokens": 5,
                "prompts_per_round": PROMPTS, "batch_prompts": 3,
            },
            "replay": {"window": 64, "max_staleness": 2, "seed": 1},
            "eval": {"prompts": 0},
            "run": {
                "dir": str(tmp_path / "run"), "run_id": "ray-test", "id_time_ms": 1,
                "mode": "async", "launcher": "ray", "actors": 1, "steps": steps,
                "batch_size": 8, "min_rows": 16, "checkpoint_every": 2, "threads": 1,
                "ray": {"num_cpus": 0.1, **ray_table},
            },
        }
    )  # fmt: skip


def _train(cfg: TrainConfig, *, resume: bool = False):
    from trainer.run.async_learner import async_train

    return async_train(cfg, resume=resume, progress=False)


def _rows(run: Path) -> list[dict]:
    store = RolloutStore.open(run / "store", create=False)
    return store.sql("SELECT rollout_id, group_id FROM rollouts").to_pylist()


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _every_row_once(run: Path) -> Counter:
    """Rows per (actor, round): ids unique, every round whole (group ids RUN/aK/rR/bB/gJ)."""
    rows = _rows(run)
    ids = [r["rollout_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a rollout id landed twice"
    rounds = Counter("/".join(r["group_id"].split("/")[1:3]) for r in rows)
    assert set(rounds.values()) == {PROMPTS * GROUP}, rounds
    return rounds


def test_async_run_with_ray_actors_trains_and_resumes(cluster, tmp_path):
    cfg = _config(tmp_path, steps=3)
    _train(cfg)
    run = tmp_path / "run"
    assert [r["step"] for r in _records(run, "train")] == [1, 2, 3]
    rounds = _every_row_once(run)
    assert {ns.split("/")[0] for ns in rounds} == {"a0"}
    # The actor's next round is kept beside the weights, where an actor on any node reads it.
    shared = json.loads((run / "weights" / "actors" / "a0.json").read_text())
    assert shared["round"] == len(rounds)
    assert not ray.util.list_named_actors() and _live_actors() == 0  # stopped with the learner

    _train(cfg.with_run(steps=4), resume=True)
    train = _records(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["learner_version"] == 3
    assert (run / "checkpoints" / "step-000000004").is_dir()
    after = _every_row_once(run)
    assert set(rounds) <= set(after)  # the resumed actor went on from its next round


def test_killed_ray_actor_is_restarted_by_ray_and_every_row_lands_once(
    cluster, tmp_path, monkeypatch
):
    monkeypatch.setenv(ACTOR_FAULT_ENV, "0:1")  # actor 0 SIGKILLs itself in round 1
    _train(_config(tmp_path, steps=4))
    run = tmp_path / "run"
    rounds = _every_row_once(run)
    assert rounds["a0/r1"] == PROMPTS * GROUP  # the killed round was finished, once
    gens = [(g["actor"], g["round"]) for g in _records(run, "generate")]
    assert gens.count((0, 1)) == 1  # the fault fired in the first incarnation only
    assert len(_records(run, "train")) == 4


def test_node_removed_mid_run_loses_and_duplicates_nothing(cluster, tmp_path, monkeypatch):
    """The actor needs a `rollout_node` resource: it starts on node A; when A is removed,
    Ray restarts it on node B, which continues from the round beside the weights."""
    from trainer.run.async_learner import AsyncLoop

    node_a = cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
    cfg = _config(tmp_path, steps=STEPS_ACROSS_NODES, resources={"rollout_node": 1})
    run = tmp_path / "run"
    # The learner holds at step PAUSE_AT until node A is gone: the actor on A, never more than
    # max_staleness = 2 versions ahead of it, cannot make the rows the later steps need, so
    # the run can only end if the actor generates again on node B (however fast A's rounds).
    paused, release = threading.Event(), threading.Event()
    before_step = AsyncLoop.before_step

    def held_before_step(loop):
        if loop.step >= PAUSE_AT and not release.is_set():
            paused.set()
            release.wait(timeout=300)
        before_step(loop)

    monkeypatch.setattr(AsyncLoop, "before_step", held_before_step)
    # The learner in a thread: Ray adds and removes nodes from the main thread only.
    failure: list[BaseException] = []

    def learner():
        try:
            _train(cfg)
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=learner, daemon=True)
    t.start()
    assert paused.wait(timeout=180) and not failure, failure
    deadline = time.monotonic() + 60  # node A's actor generated the steps so far
    while not _records(run, "generate"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
    cluster.remove_node(node_a, allow_graceful=False)
    before = len(_records(run, "generate"))
    release.set()
    t.join(timeout=300)
    assert not t.is_alive() and not failure, failure
    assert len(_records(run, "generate")) > before  # the restarted actor generated on node B
    rounds = _every_row_once(run)
    assert len(rounds) >= 2 and len(_records(run, "train")) == STEPS_ACROSS_NODES


def _live_actors() -> int:
    from ray.util.state import list_actors

    try:
        return sum(a.state == "ALIVE" for a in list_actors())
    except Exception:  # the state API needs the dashboard; then nothing to say
        return 0


def test_the_default_path_never_imports_ray(tmp_path):
    """A local async run's learner (config, loop, actor pool) and the store: no `ray`."""
    code = (
        "import sys; from trainer.config import TrainConfig; "
        "import trainer.run.async_learner as a, trainer.run.actor, rolloutstore.io.export; "
        "cfg = TrainConfig.from_dict({'run': {'mode': 'async'}}); "
        "assert cfg.run.launcher == 'local'; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'lance_ray'))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
