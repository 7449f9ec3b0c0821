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
        state dict into the generator's model; vLLM: restart the engine from the folder,
        then check its log-probs against a teacher-forced recomputation)
        if this version has already produced `ahead` rounds, wait for newer weights
        generate round r: prompts and seeds are functions of (run seed, K, r), rollout ids of
        (run id, K, r, batch), appended in atomic batches; then record r + 1 in a{K}.json

No rollout is lost or duplicated when an actor dies: a restarted actor starts again at the
round it had not finished (and finishes it even after STOP, so every round in the store is
complete), and generate_rollouts skips the batches already in the store.

Resume is not bit-for-bit: which policy version generated which round, and so which
rollouts a learner step can draw, depends on the relative speed of processes. A resumed
run continues from the newest checkpoint (weights, optimizer, loader step, policy version)
and each actor from its own next round, so nothing is regenerated and no id repeats.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutstore import RolloutStore
from rolloutstore.ids import deterministic_uuid7
from rolloutstore.replay.selector import EmptyBufferError, Selector

from .checkpoint import (
    latest_weights,
    publish_weights,
)
from .config import TrainConfig
from .generate import generate_rollouts
from .tasks import get_task
from .train import (
    Metrics,
    TrainResult,
    _run_meta,
    evaluate,
    load_model,
    prepare_model,
    save_run_checkpoint,
    setup_learner,
)

PUBLISH_EVERY = 1  # learner steps between published weights
POLL_SECONDS = 0.2  # sleep while waiting for rows (learner) or weights (actor)
MAX_RESTARTS = 5  # per actor; a crash loop (e.g. a vLLM log-prob mismatch) stops the run
JOIN_SECONDS = 120.0  # how long the learner lets actors finish their round after STOP
FAULT_ENV = "ROLLOUTSTORE_ACTOR_FAULT"  # "K:R": actor K SIGKILLs itself in round R (tests)
PARENT_ENV = "ROLLOUTSTORE_LEARNER_PID"  # actors started by a learner exit when it is gone
VERIFY_TOLERANCE = 1e-3  # vLLM vs teacher-forced log-prob gap that refuses a weight update


def actor_seed(seed: int, actor_id: int, rnd: int) -> int:
    """Prompt and sampling seed of (actor, round): distinct per pair, stable across restarts."""
    # SeedSequence mixes the three numbers; keep room below 2**31 for the per-batch "+ b".
    return int(np.random.SeedSequence([seed, actor_id, rnd]).generate_state(1)[0]) % 2**30


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
            env.pop(FAULT_ENV, None)  # an injected fault kills only the first life
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
        """Write STOP, give actors JOIN_SECONDS to finish their round, then kill stragglers.

        Killing is safe: rows are committed in atomic batches with deterministic ids.
        """
        (self.run_dir / "STOP").touch()
        deadline = time.monotonic() + JOIN_SECONDS
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
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
    from tqdm.auto import tqdm

    from .hf_generate import HFGenerator

    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = _run_meta(run_dir, cfg, resume)
    run_id = meta["run_id"]
    model_dir = prepare_model(cfg, run_dir)
    task = get_task(cfg.task.name, **cfg.task.options)
    store = RolloutStore.open(run_dir / "store")
    r = cfg.run

    learner, loader, state = setup_learner(cfg, run_dir, run_id, store, task, model_dir, resume)
    # A second selector only counts eligible rows (it records no usage, draws nothing).
    counter = Selector(store, cfg.replay, run_id=run_id, record_usage=False)
    step, totals = 0, {"train_seconds": 0.0, "wait_seconds": 0.0}
    first_eval = None
    if state is not None:
        step, first_eval = state["step"], state.get("first_eval")
        totals.update({k: v for k, v in state["totals"].items() if k in totals})

    weights_dir = run_dir / "weights"
    publish_weights(weights_dir, learner.policy_version, learner.model, template=model_dir)
    (run_dir / "STOP").unlink(missing_ok=True)
    metrics = Metrics(run_dir)
    actors = ActorPool(run_dir, r.actors, rounds_ahead(cfg), metrics)
    generator = HFGenerator(model_dir, policy_version=learner.policy_version, policy_id=run_id)

    def sync_generator() -> None:
        generator.model.load_state_dict(learner.model.state_dict())
        generator.policy_version = learner.policy_version

    bar = tqdm(total=r.steps, initial=step, desc="train", unit="step", disable=not progress)
    last_eval = first_eval
    try:
        actors.start_all()  # they start (seconds) and generate while the learner evaluates
        if first_eval is None:
            sync_generator()
            first_eval = last_eval = evaluate(generator, task, cfg)
            metrics.log("eval", step, {"reward": first_eval})
        it = iter(loader)
        waiting = False
        while step < r.steps:
            actors.check(step, bar.write)
            lv = learner.policy_version
            if _eligible_rows(counter, lv) < r.min_rows:
                if not waiting:
                    bar.write(
                        f"step {step}: waiting for {r.min_rows} eligible rows "
                        f"(learner version {lv}, {store.count()} rows in the store)"
                    )
                    waiting = True
                t0 = time.perf_counter()
                time.sleep(POLL_SECONDS)
                totals["wait_seconds"] += time.perf_counter() - t0
                continue
            waiting = False
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except EmptyBufferError:
                # Not expected after the count above, but a failed draw ends the
                # iterator; restart it at the same step and wait for rows.
                loader.load_state_dict(loader.state_dict())
                it = iter(loader)
                continue
            m = learner.step(batch)
            totals["train_seconds"] += time.perf_counter() - t0
            step += 1
            if step % PUBLISH_EVERY == 0 or step == r.steps:
                publish_weights(
                    weights_dir, learner.policy_version, learner.model, template=model_dir
                )
            stale = batch["staleness"].numpy()
            pv = batch["policy_version"].numpy()
            m.update(
                reward=float(batch["rewards"].mean()),
                learner_version=lv,
                staleness_hist={
                    int(k): int(v) for k, v in zip(*np.unique(stale, return_counts=True))
                },
                staleness_max=int(stale.max()),
                staleness_mean=float(stale.mean()),
                policy_versions=sorted({int(v) for v in pv}),
                store_version=int(batch["store_version"]),
                **totals,
            )
            metrics.log("train", step, m)
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.2f}", loss=f"{m['loss']:.3f}")
            if (r.eval_every and step % r.eval_every == 0) or step == r.steps:
                sync_generator()
                last_eval = evaluate(generator, task, cfg)
                metrics.log("eval", step, {"reward": last_eval, **totals})
                bar.write(f"step {step}: eval reward {last_eval:.3f} (start {first_eval:.3f})")
            if step % r.checkpoint_every == 0 or step == r.steps:
                save_run_checkpoint(run_dir, step, cfg, learner, loader, store, totals, first_eval)
    finally:
        bar.close()
        actors.stop()
        metrics.close()
    return TrainResult(run_dir, run_dir / "store", step, first_eval, last_eval)


# -- an actor --------------------------------------------------------------------------------
def _fault(actor_id: int, rnd: int, batch: int) -> None:
    """SIGKILL this actor after round R's first batch when ROLLOUTSTORE_ACTOR_FAULT="K:R"."""
    spec = os.environ.get(FAULT_ENV)
    if spec and batch == 0 and spec == f"{actor_id}:{rnd}":
        os.kill(os.getpid(), signal.SIGKILL)


def _orphaned() -> bool:
    """True when the learner that started this actor has exited (we were re-parented)."""
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: a crash leaves the old round or the new one


def _log_line(path: Path, record: dict[str, Any]) -> None:
    # One write() of one short line in append mode: lines from several processes do not mix.
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _HFPolicy:
    """HF backend: one generator for the actor's life; new versions are loaded in place."""

    def __init__(self, model_dir: Path, run_id: str):
        from .hf_generate import HFGenerator

        self.gen = HFGenerator(model_dir, policy_version=0, policy_id=run_id)

    def load(self, version: int, folder: Path):
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))  # FileNotFoundError if pruned
        self.gen.model.load_state_dict(state, strict=True)
        self.gen.policy_version = version
        return self.gen

    def close(self) -> None:
        pass


class _VLLMPolicy:
    """vLLM backend: restart the engine from each published folder, then verify it.

    In-place weight reload is broken on CPU (repacked linear layers keep the old
    weights, see shared/PLATFORM.md), so every version starts a fresh engine; a
    few sampled tokens' log-probs must match a teacher-forced recomputation of the
    same weights within VERIFY_TOLERANCE, or the actor refuses to generate.
    """

    def __init__(self, cfg: TrainConfig, run_id: str, seed: int):
        self.cfg, self.run_id, self.seed = cfg, run_id, seed
        self.gen = None

    def load(self, version: int, folder: Path):
        from .vllm_generate import VLLMGenerator

        self.close()
        self.gen = VLLMGenerator(
            folder, policy_version=version, policy_id=self.run_id, seed=self.seed
        )
        verify_logprobs(self.gen, folder, self.cfg)
        return self.gen

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
            self.gen = None


def verify_logprobs(gen: Any, folder: Path, cfg: TrainConfig, prompts: int = 2) -> float:
    """Largest |generator log-prob - teacher-forced log-prob| on a few samples; raises if > tol."""
    from .hf_generate import max_logprob_gap

    g = cfg.generation
    task = get_task(cfg.task.name, **cfg.task.options)
    texts = [p.prompt_text for p in task.make_prompts(prompts, seed=123_457)]
    rows = gen.generate(
        texts,
        group_size=2,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_tokens=g.max_tokens,
        seed=0,
    )
    model, _ = load_model(folder)
    gap = max_logprob_gap(model, rows)
    if not gap <= VERIFY_TOLERANCE:
        raise RuntimeError(
            f"generator log-probs differ from the teacher-forced ones of {folder} by {gap:.2e} "
            f"(> {VERIFY_TOLERANCE}); refusing to generate with weights it may not hold"
        )
    return gap


def run_actor(
    run_dir: str | os.PathLike,
    actor_id: int,
    *,
    weights_dir: str | os.PathLike | None = None,
    rounds_ahead: int = 2,
) -> int:
    """Actor ``actor_id`` of the run in ``run_dir`` (see the module docstring); returns rounds."""
    run_dir = Path(run_dir).resolve()
    meta = json.loads((run_dir / "run.json").read_text())
    cfg = TrainConfig.from_dict(meta["config"])
    run_id, start_ms = meta["run_id"], meta["start_ms"]
    g, r = cfg.generation, cfg.run
    weights_dir = Path(weights_dir) if weights_dir else run_dir / "weights"
    task = get_task(cfg.task.name, **cfg.task.options)
    store = RolloutStore.open(run_dir / "store")
    state_path = run_dir / "actors" / f"a{actor_id}.json"
    state_path.parent.mkdir(exist_ok=True)
    rnd = int(_read_json(state_path).get("round", 0))
    backend = g.backend
    if backend == "auto":
        import importlib.util

        backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    # Learner and actors share the CPU cores; one thread each avoids oversubscription.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (r.actors + 1)))
    policy = (
        _VLLMPolicy(cfg, run_id, seed=r.seed + actor_id)
        if backend == "vllm"
        else _HFPolicy(prepare_model(cfg, run_dir), run_id)  # the learner built it already
    )
    # A round an earlier life started (its first batch is in the store) is finished even if
    # STOP is already there, so every round in the store ends up complete.
    first = deterministic_uuid7(f"{run_id}/a{actor_id}/r{rnd}/b0/0", start_ms)
    unfinished = store.count(filter=f"rollout_id = '{first}'") > 0
    print(
        f"actor {actor_id}: pid {os.getpid()}, backend {backend}, starting at round {rnd}"
        + (" (left unfinished by an earlier life)" if unfinished else ""),
        flush=True,
    )
    gen, version, done_at_version, rounds = None, -1, 0, 0
    try:
        while unfinished or not ((run_dir / "STOP").exists() or _orphaned()):
            latest = latest_weights(weights_dir)
            if latest is not None and latest[0] > version:
                try:
                    gen = policy.load(*latest)
                except FileNotFoundError:
                    continue  # pruned by a newer publish meanwhile: read LATEST again
                version, done_at_version = latest[0], 0
                print(f"actor {actor_id}: loaded policy version {version}", flush=True)
            if gen is None or (done_at_version >= rounds_ahead and not unfinished):
                time.sleep(POLL_SECONDS)  # no weights yet, or far enough ahead of the learner
                continue
            seed = actor_seed(r.seed, actor_id, rnd)
            summary = generate_rollouts(
                store,
                model=gen,
                task=task,
                prompts=task.make_prompts(g.prompts_per_round, seed=seed),
                group_size=g.group_size,
                policy_version=version,
                backend=backend,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                max_tokens=g.max_tokens,
                seed=seed,
                batch_prompts=g.batch_prompts,
                run_id=run_id,
                policy_id=run_id,
                progress=False,
                id_namespace=f"{run_id}/a{actor_id}/r{rnd}",
                id_time_ms=start_ms,
                on_append=lambda b, rnd=rnd: _fault(actor_id, rnd, b),
            )
            rnd += 1
            rounds += 1
            unfinished = False
            done_at_version += 1
            _write_json(state_path, {"round": rnd})
            _log_line(
                run_dir / "metrics.jsonl",
                {
                    "kind": "generate",
                    "step": version,  # an actor knows no learner step; version = steps taken
                    "time": time.time(),
                    "actor": actor_id,
                    "round": rnd - 1,
                    "policy_version": version,
                    "rollouts": summary.rollouts,
                    "tokens": summary.tokens,
                    "reward": summary.mean_reward,
                    "seconds": summary.seconds,
                    "store_version": summary.store_version,
                },
            )
            print(
                f"actor {actor_id}: round {rnd - 1} with version {version}: {summary.line()}",
                flush=True,
            )
    finally:
        policy.close()
    return rounds
