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
    fetch_weights,
    latest_weights,
    publish_weights,
    read_text,
    remove_text,
    write_text,
)
from .config import (
    STORE_ENV,
    WEIGHTS_ENV,
    ConfigError,
    TrainConfig,
    configured_location,
    storage_options_from_env,
)
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
    store_location,
)
from .vllm_update import VERIFY_TOLERANCE  # no vLLM import: safe without vLLM

PUBLISH_EVERY = 1  # learner steps between published weights
POLL_SECONDS = 0.2  # sleep while waiting for rows (learner) or weights (actor)
MAX_RESTARTS = 5  # per actor; a crash loop (e.g. a vLLM log-prob mismatch) stops the run
JOIN_SECONDS = 120.0  # how long the learner lets actors finish their round after STOP
FAULT_ENV = "ROLLOUTSTORE_ACTOR_FAULT"  # "K:R": actor K SIGKILLs itself in round R (tests)
PARENT_ENV = "ROLLOUTSTORE_LEARNER_PID"  # actors started by a learner exit when it is gone


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
    store_uri, options = store_location(cfg, run_dir)
    store = RolloutStore.open(store_uri, storage_options=options)
    r = cfg.run

    learner, loader, state = setup_learner(cfg, run_dir, run_id, store, task, model_dir, resume)
    # A second selector only counts eligible rows (it records no usage, draws nothing).
    counter = Selector(store, cfg.replay, run_id=run_id, record_usage=False)
    step, totals = 0, {"train_seconds": 0.0, "wait_seconds": 0.0}
    first_eval = None
    if state is not None:
        step, first_eval = state["step"], state.get("first_eval")
        totals.update({k: v for k, v in state["totals"].items() if k in totals})

    weights_dir = configured_location(cfg, "weights") or run_dir / "weights"
    # Standalone actors (other machines) learn the run's identity from the weights location.
    write_text(weights_dir, "run.json", json.dumps(meta), options)
    remove_text(weights_dir, "STOP", options)
    publish_weights(
        weights_dir, learner.policy_version, learner.model, template=model_dir,
        storage_options=options,
    )  # fmt: skip
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
                    weights_dir, learner.policy_version, learner.model, template=model_dir,
                    storage_options=options,
                )  # fmt: skip
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
        try:
            write_text(weights_dir, "STOP", "", options)  # standalone actors stop too
        finally:
            actors.stop()
            metrics.close()
    return TrainResult(run_dir, store_uri, step, first_eval, last_eval)


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
    """HF backend: one generator for the actor's life, built from the first published folder
    (a complete model folder, so an actor needs no local model); later versions load in place."""

    def __init__(self, run_id: str):
        self.run_id, self.gen = run_id, None

    def load(self, version: int, folder: Path):
        from safetensors.torch import load_file

        if self.gen is None:
            self.gen = self._first(version, folder)
        else:
            state = load_file(str(folder / "model.safetensors"))  # FileNotFoundError if pruned
            self.gen.model.load_state_dict(state, strict=True)
        self.gen.policy_version = version
        return self.gen

    def _first(self, version: int, folder: Path):
        """The generator, built from a private copy of ``folder``: a newer publish may prune
        the folder at any time, and building (config, tokenizer, weights) takes long enough
        for a learner to publish and prune several versions. A copy is quick; if the folder
        goes while it is copied, that is FileNotFoundError (the caller reads LATEST again)."""
        import shutil
        import tempfile

        from .hf_generate import HFGenerator

        with tempfile.TemporaryDirectory(prefix="actor-weights-") as tmp:
            copy = Path(tmp) / folder.name
            try:
                shutil.copytree(folder, copy)
            except (FileNotFoundError, shutil.Error) as exc:
                raise FileNotFoundError(f"published weights {folder} were pruned") from exc
            if not all((copy / f).is_file() for f in ("config.json", "model.safetensors")):
                raise FileNotFoundError(f"published weights {folder} were pruned")
            return HFGenerator(copy, policy_version=version, policy_id=self.run_id)

    def close(self) -> None:
        pass


class _VLLMPolicy:
    """vLLM backend: one engine per actor life; each new version is loaded in place, verified.

    The first version starts the engine from its published folder (checked by
    verify_logprobs). Later versions are loaded into the running engine
    (VLLMGenerator.update_weights, see trainer/vllm_update.py), after which a few sampled
    tokens' log-probs must match a teacher-forced recomputation of the new weights within
    VERIFY_TOLERANCE. An update that fails this check is logged and the engine restarted
    from the folder, which is verified again; a mismatch there stops the actor.
    """

    def __init__(self, cfg: TrainConfig, run_id: str, seed: int, *, verbose: bool = True):
        self.cfg, self.run_id, self.seed, self.verbose = cfg, run_id, seed, verbose
        self.gen = None
        self.last_gap: float | None = None  # of the newest verification
        self.restarts = 0  # engine starts, the first included
        self.in_place = 0  # versions loaded into the running engine

    def load(self, version: int, folder: Path):
        """Load the published ``folder`` of ``version`` (FileNotFoundError if it was pruned)."""
        from safetensors.torch import load_file

        if self.gen is None:
            return self._restart(version, folder)
        state = load_file(str(folder / "model.safetensors"))
        return self.update(version, state, lambda: folder)

    def update(self, version: int, state: dict, folder):
        """Load ``state`` in place; ``folder()`` publishes it for the restart fallback."""
        from .vllm_update import WeightUpdateError

        if self.gen is None:
            return self._restart(version, folder())
        g = self.cfg.generation
        task = get_task(self.cfg.task.name, **self.cfg.task.options)
        try:
            u = self.gen.update_weights(
                state,
                policy_version=version,
                verify_prompts=[p.prompt_text for p in task.make_prompts(2, seed=123_457)],
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                max_tokens=g.max_tokens,
                tolerance=VERIFY_TOLERANCE,
            )
        except WeightUpdateError as exc:
            print(f"policy version {version}: {exc}; restarting the engine", flush=True)
            return self._restart(version, folder())
        self.last_gap = u.gap
        self.in_place += 1
        if self.verbose:
            print(
                f"policy version {version}: updated in place and verified (max log-prob gap "
                f"{u.gap:.1e}; load {u.update_seconds:.2f} s, verify {u.verify_seconds:.2f} s)",
                flush=True,
            )
        return self.gen

    def _restart(self, version: int, folder: Path):
        from .vllm_generate import VLLMGenerator

        self.close()
        self.gen = VLLMGenerator(
            folder, policy_version=version, policy_id=self.run_id, seed=self.seed
        )
        self.restarts += 1
        self.last_gap = verify_logprobs(self.gen, folder, self.cfg)
        if self.verbose:
            print(
                f"policy version {version}: engine started from {folder} and verified "
                f"(max log-prob gap {self.last_gap:.1e})",
                flush=True,
            )
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


def _actor_source(
    source: str | os.PathLike | TrainConfig,
    *,
    weights_dir: str | os.PathLike | None,
    store_uri: str | None,
    state_dir: str | os.PathLike | None,
    options: dict[str, str] | None,
) -> tuple[TrainConfig, dict[str, Any], str, str | Path, Path, Path | None]:
    """(config, run meta, store URI, weights location, state folder, run folder or None).

    ``source``: a run folder the learner owns (holds run.json), or a config for a
    standalone actor, which learns the run id and id time from ``WEIGHTS/run.json``.
    """
    if not isinstance(source, TrainConfig) and (Path(source) / "run.json").is_file():
        run_dir = Path(source).resolve()
        meta = json.loads((run_dir / "run.json").read_text())
        cfg = TrainConfig.from_dict(meta["config"])
        weights = weights_dir or configured_location(cfg, "weights") or run_dir / "weights"
        store = store_uri or configured_location(cfg, "store") or str(run_dir / "store")
        return cfg, meta, store, weights, Path(state_dir or run_dir / "actors"), run_dir
    cfg = source if isinstance(source, TrainConfig) else TrainConfig.load(source)
    weights = weights_dir or configured_location(cfg, "weights")
    store = store_uri or configured_location(cfg, "store")
    if not weights or not store:
        raise ConfigError(
            f"a standalone actor needs the shared store and weights: pass --store URI and "
            f"--learner-weights URI (or [run] store / weights, or ${STORE_ENV} / ${WEIGHTS_ENV}); got store={store!r}, "
            f"weights={weights!r}"
        )
    text = read_text(weights, "run.json", options)
    if text is None:
        raise FileNotFoundError(
            f"no run.json at {weights}: start the learner first (it publishes run.json with "
            "its first weights), or check --learner-weights"
        )
    meta = json.loads(text)
    if cfg.run.run_id and cfg.run.run_id != meta["run_id"]:
        raise ConfigError(
            f"[run].run_id is {cfg.run.run_id!r} but the learner at {weights} runs "
            f"{meta['run_id']!r}; drop [run].run_id or point --learner-weights at that run"
        )
    return cfg, meta, store, weights, Path(state_dir or Path(cfg.run.dir) / "actors"), None


def run_actor(
    source: str | os.PathLike | TrainConfig,
    actor_id: int,
    *,
    weights_dir: str | os.PathLike | None = None,
    rounds_ahead: int = 2,
    store_uri: str | None = None,
    storage_options: dict[str, str] | None = None,
    state_dir: str | os.PathLike | None = None,
    max_rounds: int | None = None,
) -> int:
    """Actor ``actor_id`` (see the module docstring); returns the rounds it generated.

    ``source``: the run folder (the learner starts actors this way), or a config for a
    standalone actor on another machine, which needs ``store_uri`` and ``weights_dir``
    (local paths or object-store URIs; ``storage_options`` default to
    $ROLLOUTSTORE_STORAGE_OPTIONS). It stops when the learner writes STOP beside the
    weights, or after ``max_rounds``. ``state_dir`` keeps its next round (a{K}.json)
    and, for object-store weights, the downloaded versions.
    """
    options = storage_options if storage_options is not None else storage_options_from_env()
    cfg, meta, store_uri, weights_dir, state_dir, run_dir = _actor_source(
        source, weights_dir=weights_dir, store_uri=store_uri, state_dir=state_dir, options=options
    )
    run_id, start_ms = meta["run_id"], meta["start_ms"]
    g, r = cfg.generation, cfg.run
    task = get_task(cfg.task.name, **cfg.task.options)
    store = RolloutStore.open(store_uri, storage_options=options)
    state_path = state_dir / f"a{actor_id}.json"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    rnd = int(_read_json(state_path).get("round", 0))
    backend = g.backend
    if backend == "auto":
        import importlib.util

        backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    # Learner and actors share the CPU cores; one thread each avoids oversubscription.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (r.actors + 1)))
    policy = (
        _VLLMPolicy(cfg, run_id, seed=r.seed + actor_id) if backend == "vllm" else _HFPolicy(run_id)
    )

    def stopped() -> bool:
        if max_rounds is not None and rounds >= max_rounds:
            return True
        if run_dir is not None and ((run_dir / "STOP").exists() or _orphaned()):
            return True
        return read_text(weights_dir, "STOP", options) is not None

    # A round an earlier life started (its first batch is in the store) is finished even if
    # STOP is already there, so every round in the store ends up complete.
    first = deterministic_uuid7(f"{run_id}/a{actor_id}/r{rnd}/b0/0", start_ms)
    unfinished = store.count(filter=f"rollout_id = '{first}'") > 0
    print(
        f"actor {actor_id}: pid {os.getpid()}, backend {backend}, store {store_uri}, weights "
        f"{weights_dir}, starting at round {rnd}"
        + (" (left unfinished by an earlier life)" if unfinished else ""),
        flush=True,
    )
    gen, version, done_at_version, rounds = None, -1, 0, 0
    try:
        while unfinished or not stopped():
            latest = latest_weights(weights_dir, options)
            if latest is not None and latest[0] > version:
                try:
                    folder = fetch_weights(latest[1], state_dir / "weights", options)
                    gen = policy.load(latest[0], folder)
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
                (run_dir or state_dir) / "metrics.jsonl",
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
