"""Async mode: actor processes generate into the store while a learner trains from it.

    rolloutstore-train train examples/arith.toml --set 'run.mode="async"' --actors 2
    rolloutstore-train resume runs/arith                  # continues from the newest checkpoint
    rolloutstore-train actor runs/arith --actor-id 0      # what the learner starts, per actor

The two sides share nothing but files in the run folder:

    RUN_DIR/store        the Lance rollout store; every actor appends, the learner reads
    RUN_DIR/weights      published policy versions + an atomic LATEST file (learner -> actors)
    RUN_DIR/actors/      a{K}.json (actor K's next round), a{K}.log (its stdout and stderr)
    RUN_DIR/STOP         written by the learner at the end: actors finish their round and exit

Learner, top to bottom:

    build or load the model (warm start on a fresh run), publish its weights as the
    current policy version, start run.actors actor processes
    repeat until run.steps learner steps:
        check the actors; restart any that died (logged as kind "actor_restart")
        wait until the buffer holds run.min_rows eligible rows (window, max_staleness, ...)
        one learner step on a batch the selector draws for learner_version = policy_version
        publish the new weights (every PUBLISH_EVERY steps: 1, so actors are at most one
        generation round behind); metrics, evals and checkpoints as in sync mode
    write STOP, wait for the actors to exit

Actor K, top to bottom:

    repeat until RUN_DIR/STOP exists (or the learner that started it is gone):
        if LATEST names a newer version than the loaded one: load it (HF: the safetensors
        state dict into the generator's model; vLLM: load it into the running engine in
        place, then check its log-probs against a teacher-forced recomputation; restart
        the engine from the folder only if that check fails)
        if this version has already produced `ahead` rounds, wait for newer weights
        generate round r: prompts and seeds are functions of (run seed, K, r), rollout ids of
        (the run's id prefix, K, r, batch), appended in atomic batches; then record r + 1 in
        a{K}.json (the prefix: with [run].ids = "seeded", the seed and a hash of the config)

No rollout is lost or duplicated when an actor dies: a restarted actor starts again at the
round it had not finished (and finishes it even after STOP, so every round in the store is
complete), and generate_rollouts skips the batches already in the store.

Twin runs are not identical either (same seed and config, two folders): each actor round's
prompts, sampling seeds and rollout ids agree, but which policy version samples round r,
the order the rounds reach the store, and so each step's draw and the final weights, follow
the processes' relative speed. Use the sync loop for runs that must repeat exactly.

Resume is not bit-for-bit: which policy version generated which round, and so which
rollouts a learner step can draw, depends on the relative speed of processes. A resumed
run continues from the newest checkpoint (weights, optimizer, loader step, policy version)
and each actor from its own next round, so nothing is regenerated and no id repeats.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rolloutstore import RolloutStore
from rolloutstore.replay.budget import budget_metrics
from rolloutstore.replay.selector import EmptyBufferError, Selector
from trainer.config import (
    TrainConfig,
    configured_location,
)
from trainer.rollout.evaluation import EvalResult
from trainer.rollout.weights import remove_text, write_text
from trainer.run.actor import JOIN_SECONDS, PARENT_ENV, POLL_SECONDS
from trainer.run.checkpoint import save_run_checkpoint
from trainer.run.faults import ACTOR_FAULT_ENV
from trainer.run.loop import TIME_KEYS, Loop
from trainer.run.metrics import Metrics
from trainer.run.setup import (
    TrainResult,
    evaluate,
    prepare_model,
    removed_on_failure,
    report_sources,
    run_meta,
    run_publisher,
    setup_learner,
    store_location,
)

PUBLISH_EVERY = 1  # learner steps between published weights
MAX_RESTARTS = 5  # per actor; a crash loop (e.g. a vLLM log-prob mismatch) stops the run
TERM_SECONDS = 30.0  # then how long a SIGTERM'd actor has to stop its engine before SIGKILL


def rounds_ahead(cfg: TrainConfig) -> int:
    """Rounds an actor may generate with one policy version before it waits for newer weights.

    Enough that all actors together can fill ``min_rows`` from a single version (else the
    learner would wait for rows and the actors for weights, forever), and at least 2 so
    that actors keep generating while the learner takes its next step.
    """
    per_round = cfg.generation.prompts_per_round * cfg.generation.group_size
    return max(2, math.ceil(cfg.run.min_rows / (cfg.run.actors * per_round)))


# -- the learner -----------------------------------------------------------------------------
class ActorPool:
    """The learner's actor processes: start, check (restart the dead), stop."""

    def __init__(self, run_dir: Path, n: int, ahead: int, metrics: Metrics):
        self.run_dir, self.n, self.ahead, self.metrics = run_dir, n, ahead, metrics
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarts = dict.fromkeys(range(n), 0)
        (run_dir / "actors").mkdir(exist_ok=True)

    def start(self, k: int, *, first_life: bool) -> None:
        # The actor imports this package, wherever the learner was started from.
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONPATH": path}
        if not first_life:
            env.pop(ACTOR_FAULT_ENV, None)  # an injected fault kills only the first life
        cmd = [sys.executable, "-m", "trainer", "actor", str(self.run_dir), "--actor-id", str(k)]
        cmd += ["--rounds-ahead", str(self.ahead)]
        with open(self.run_dir / "actors" / f"a{k}.log", "a") as log:  # the child keeps its own
            self.procs[k] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_all(self) -> None:
        for k in range(self.n):
            self.start(k, first_life=True)

    def check(self, step: int, write) -> None:
        """Restart any actor that exited although STOP was not written."""
        for k, p in self.procs.items():
            rc = p.poll()
            if rc is None:
                continue
            self.restarts[k] += 1
            write(
                f"actor {k} exited with code {rc}; restarting it "
                f"({self.restarts[k]} restart(s), log {self.run_dir / 'actors' / f'a{k}.log'})"
            )
            self.metrics.log(
                "actor_restart", step, {"actor": k, "returncode": rc, "restarts": self.restarts[k]}
            )
            if self.restarts[k] > MAX_RESTARTS:
                raise RuntimeError(f"actor {k} died {self.restarts[k]} times; see its log")
            self.start(k, first_life=False)

    def stop(self) -> None:
        """Write STOP, give actors JOIN_SECONDS to finish their round, then stop stragglers:
        SIGTERM first (the actor's cleanup stops its vLLM engine), SIGKILL after TERM_SECONDS.

        Killing is safe: rows are committed in atomic batches with deterministic ids.
        """
        (self.run_dir / "STOP").touch()
        deadline = time.monotonic() + JOIN_SECONDS
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=TERM_SECONDS)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _eligible_rows(selector: Selector, learner_version: int) -> int:
    try:
        return selector.candidates(learner_version).num_rows
    except EmptyBufferError:
        return 0


def async_train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or resume) the async loop described in the module docstring (learner side)."""
    with removed_on_failure(Path(cfg.run.dir), resume=resume):
        loop = AsyncLoop(cfg, resume=resume)
    return loop.run(progress=progress)


class AsyncLoop(Loop):
    """The async learner of one run: ``AsyncLoop(cfg, resume=...).run()``.

    Setup (run folder, model, store, learner, loader, the weights location with the first
    published version) happens in ``__init__``; ``run`` is :meth:`trainer.run.loop.Loop.run`:
    the actors start before the first evaluation, each step waits for eligible rows
    (:meth:`before_step`) and publishes its weights (:meth:`after_step`), and the actors are
    stopped at the end.
    """

    def __init__(self, cfg: TrainConfig, *, resume: bool):
        self.t0 = time.perf_counter()  # startup_seconds count from here (trainer.run.loop)
        r = cfg.run
        self.cfg, self.main = cfg, True
        self.run_dir = run_dir = Path(r.dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        meta = run_meta(run_dir, cfg, resume)
        self.run_id = meta["run_id"]
        self.model_dir = prepare_model(cfg, run_dir)
        self.task = cfg.task.build()
        self.store_uri, self.options = store_location(cfg, run_dir)
        self.store = RolloutStore.open(self.store_uri, storage_options=self.options)
        self.learner, self.loader, state = setup_learner(
            cfg, run_dir, self.run_id, self.store, self.task, self.model_dir, resume
        )
        # A second selector only counts eligible rows (it records no usage, draws nothing).
        self.counter = Selector(self.store, cfg.replay, run_id=self.run_id, record_usage=False)
        self.step, self.totals, self.first_eval = _progress(state)
        self.last_eval = self.first_eval
        self.generated = _Generated(self.store, self.run_id)

        self.weights_dir = _open_weights(cfg, run_dir, meta, self.options)
        self.publisher = run_publisher(cfg, run_dir, self.learner.device, self.options)
        self._publish()
        (run_dir / "STOP").unlink(missing_ok=True)
        self.metrics = Metrics(run_dir, state)  # records after the checkpoint dropped
        if state is None:  # from step 0: what the imported rows give this run
            report_sources(cfg, self.store, self.run_id, self.metrics)
        self.actors = _actor_pool(
            cfg, run_dir, self.metrics, self.weights_dir, self.store_uri, self.options
        )
        self.generator = _eval_generator(
            cfg, self.model_dir, self.learner.policy_version, self.run_id
        )

    def start(self) -> None:
        self.actors.start_all()  # they start (seconds) and generate while the learner evaluates

    def before_step(self) -> None:
        """The actors checked (the dead restarted), until run.min_rows rows are eligible."""
        r, waiting = self.cfg.run, False
        self.actors.check(self.step, self.bar.write)
        self.version = self.learner.policy_version  # the batch is drawn for this version
        while _eligible_rows(self.counter, self.version) < r.min_rows:
            if not waiting:
                self.bar.write(_waiting_line(self.step, r.min_rows, self.version, self.store))
            waiting = True
            self.totals["wait_seconds"] += _sleep(POLL_SECONDS)
            self.actors.check(self.step, self.bar.write)

    def draw(self) -> dict[str, Any] | None:
        try:
            return next(self.it)
        except EmptyBufferError:
            # Not expected after the count in before_step, but a failed draw ends the
            # iterator; restart it at the same step and wait for rows.
            self.it = self.loader.restart(self.it)
            return None

    def after_step(self, m: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
        """The new weights published; the step's train record: the learner's metrics, its
        batch's, the totals so far."""
        r = self.cfg.run
        if self.step % PUBLISH_EVERY == 0 or self.step == r.steps:
            t0 = time.perf_counter()
            self._publish()  # the actors load it in their own time (their records say how long)
            self.totals["sync_seconds"] += time.perf_counter() - t0
        m.update(_batch_metrics(batch, self.version), **self.totals, **self.generated.read())
        # Mean uses per generated rollout so far (sync runs log the planned y * B / R).
        m["replay_ratio"] = self.step * r.batch_size / max(1, m["generated_rollouts"])
        return m

    def evaluate(self) -> EvalResult | None:
        """The evaluation of the learner's current weights, loaded into the HF generator."""
        self.generator.model.load_state_dict(self.learner.full_weights())  # LoRA: merged
        self.generator.policy_version = self.learner.policy_version
        return evaluate(self.generator, self.task, self.cfg)

    def checkpoint(self) -> None:
        # No record count: the actors append their own records to metrics.jsonl, so a count of
        # the learner's lines would cut theirs and ours short; a resume keeps records by step.
        save_run_checkpoint(
            self.run_dir, self.step, self.cfg, self.learner, self.loader, self.store,
            self.totals, self.first_eval,
        )  # fmt: skip

    def close(self) -> None:
        try:
            write_text(self.weights_dir, "STOP", "", self.options)  # standalone actors stop too
        finally:
            self.actors.stop()
            self.metrics.close()

    def _publish(self) -> None:
        # A LoRA learner publishes its adapters, in the run's precision; retention keeps the
        # checkpoints' versions (trainer/rollout/weights.py).
        self.publisher.publish(
            self.weights_dir, self.learner.policy_version, self.learner.model, self.model_dir
        )


def _actor_pool(cfg: TrainConfig, run_dir: Path, metrics: Metrics, weights_dir, store_uri, options):
    """The actors' launcher: processes beside the learner, or Ray actors ([run] launcher)."""
    r = cfg.run
    if r.launcher == "local":
        return ActorPool(run_dir, r.actors, rounds_ahead(cfg), metrics)
    from trainer.run.ray_actors import RayActorPool  # Ray is imported only here

    return RayActorPool(
        run_dir, r.actors, rounds_ahead(cfg), metrics, ray_cfg=r.ray, weights_dir=weights_dir,
        store_uri=store_uri, options=options, train_cfg=cfg,
    )  # fmt: skip


def _progress(state: dict[str, Any] | None) -> tuple[int, dict[str, float], float | None]:
    """(step, time totals, first eval reward) of a fresh run, or of the checkpoint ``state``."""
    step, totals = 0, {**dict.fromkeys(TIME_KEYS, 0.0), "wait_seconds": 0.0}
    first_eval = None
    if state is not None:
        step, first_eval = state["step"], state.get("first_eval")
        totals.update({k: v for k, v in state["totals"].items() if k in totals})
    return step, totals, first_eval


def _open_weights(cfg: TrainConfig, run_dir: Path, meta: dict[str, Any], options) -> str | Path:
    """The weights location, holding this run's run.json and no STOP."""
    weights_dir = configured_location(cfg, "weights") or run_dir / "weights"
    # Standalone actors (other machines) learn the run's identity from the weights location.
    write_text(weights_dir, "run.json", json.dumps(meta), options)
    remove_text(weights_dir, "STOP", options)
    return weights_dir


def _eval_generator(cfg: TrainConfig, model_dir: Path, version: int, run_id: str) -> Any:
    """The learner's eval generator, on the device and in the precision the sync loop's and
    the actors' generators use."""
    from trainer.rollout.hf import HFGenerator

    return HFGenerator(
        model_dir, policy_version=version, policy_id=run_id,
        device=cfg.model.device, dtype=cfg.generation.dtype,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
    )  # fmt: skip


def _waiting_line(step: int, min_rows: int, learner_version: int, store: RolloutStore) -> str:
    return (
        f"step {step}: waiting for {min_rows} eligible rows "
        f"(learner version {learner_version}, {store.count()} rows in the store)"
    )


def _sleep(seconds: float) -> float:
    t0 = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t0


def _batch_metrics(batch: dict[str, Any], learner_version: int) -> dict[str, Any]:
    """What a train record says of its batch: reward, staleness, policy versions drawn."""
    stale = batch["staleness"].numpy()
    extra = {}
    if batch.get("no_embedding") is not None:  # diversity="embedding": rows it fell back on
        extra["no_embedding"] = int(batch["no_embedding"])
    return {
        "reward": float(batch["rewards"].mean()),
        "learner_version": learner_version,
        "staleness_hist": {int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))},
        "staleness_max": int(stale.max()),
        "staleness_mean": float(stale.mean()),
        "policy_versions": sorted({int(v) for v in batch["policy_version"].numpy()}),
        "store_version": int(batch["store_version"]),
        **budget_metrics(batch),  # rows trained, and what [run].max_tokens_per_batch cut
        **extra,
    }


class _Generated:
    """What the actors have generated for this run so far (rollouts, completion tokens), read
    from the store, re-read only when its version moved."""

    def __init__(self, store: RolloutStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.version: int | None = None
        self.totals = {"generated_rollouts": 0, "generated_tokens": 0}

    def read(self) -> dict[str, Any]:
        """The totals, and ``policy_reward``: the mean reward of the newest policy version's
        rollouts (the actors' newest rounds), the policy's own beside the replayed batch's."""
        version = self.store.version
        if version != self.version:
            row = self.store.sql(
                "SELECT count(*) AS n, coalesce(sum(num_model_tokens), 0) AS t, "
                "avg(reward) FILTER (WHERE policy_version = (SELECT max(policy_version) "
                "FROM rollouts WHERE run_id = ?)) AS r FROM rollouts WHERE run_id = ?",
                [self.run_id, self.run_id],
            ).to_pylist()[0]
            self.version = version
            self.totals = {"generated_rollouts": int(row["n"]), "generated_tokens": int(row["t"])}
            if row["r"] is not None:
                self.totals["policy_reward"] = float(row["r"])
        return dict(self.totals)
