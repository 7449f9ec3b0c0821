"""An async actor: generate rounds into the store with the newest published weights.

    rolloutstore-train actor runs/arith --actor-id 0      # what the learner starts, per actor

See :mod:`trainer.run.async_learner` for the protocol between learner and actors.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutstore import RolloutStore
from trainer.config import (
    STORE_ENV,
    WEIGHTS_ENV,
    TrainConfig,
    configured_location,
    process_threads,
    storage_options_from_env,
)
from trainer.errors import ConfigError
from trainer.rollout.pipeline import RoundIds, generate_rollouts, resolve_backend
from trainer.rollout.policy import actor_policy
from trainer.rollout.weights import (
    fetch_weights,
    is_remote,
    latest_weights,
    read_text,
    write_text,
)
from trainer.run.faults import actor_crash
from trainer.run.resume import effective_config

POLL_SECONDS = 0.2  # sleep while waiting for rows (learner) or weights (actor)
JOIN_SECONDS = 120.0  # how long a stopping learner lets actors finish their round (STOP)


PARENT_ENV = "ROLLOUTSTORE_LEARNER_PID"  # actors started by a learner exit when it is gone


def actor_seed(seed: int, actor_id: int, rnd: int) -> int:
    """Prompt and sampling seed of (actor, round): distinct per pair, stable across restarts."""
    # SeedSequence mixes the three numbers; keep room below 2**31 for the per-batch "+ b".
    return int(np.random.SeedSequence([seed, actor_id, rnd]).generate_state(1)[0]) % 2**30


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
        cfg = TrainConfig.from_dict(effective_config(meta))  # as of the newest resume
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
    state_beside_weights: bool = False,
) -> int:
    """Actor ``actor_id`` (see the module docstring); returns the rounds it generated.

    ``source``: the run folder (the learner starts actors this way), or a config for a
    standalone actor on another machine, which needs ``store_uri`` and ``weights_dir``
    (local paths or object-store URIs; ``storage_options`` default to
    $ROLLOUTSTORE_STORAGE_OPTIONS). It stops when the learner writes STOP beside the
    weights, or after ``max_rounds``. ``state_dir`` keeps its next round (a{K}.json)
    and, for object-store weights, the downloaded versions. ``state_beside_weights``: the
    next round is also kept in ``WEIGHTS/actors/a{K}.json`` (the Ray launcher: an actor
    restarted on another node continues from there, not from a lost local disk).
    """
    options = storage_options if storage_options is not None else storage_options_from_env()
    cfg, meta, store_uri, weights_dir, state_dir, run_dir = _actor_source(
        source, weights_dir=weights_dir, store_uri=store_uri, state_dir=state_dir, options=options
    )
    run_id = meta["run_id"]
    g, r = cfg.generation, cfg.run
    task = cfg.task.build()
    store = RolloutStore.open(store_uri, storage_options=options)
    state_path = state_dir / f"a{actor_id}.json"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    shared = _actors_dir(weights_dir) if state_beside_weights else None
    rnd = _next_round(state_path, shared, actor_id, options)
    backend = resolve_backend(g.backend)
    # Learner and actors share the CPU cores ([run] threads: by default an even share each);
    # a vLLM CPU engine binds its own block of them (actor k the k+1-th, the learner's first).
    threads = process_threads(r)
    torch.set_num_threads(threads)
    policy = actor_policy(
        backend, cfg, task, run_id, seed=r.seed + actor_id, threads=threads, slot=actor_id + 1,
        engine_log=(run_dir or state_dir) / f"engine-a{actor_id}.log",
    )  # fmt: skip

    def stopped() -> bool:
        if max_rounds is not None and rounds >= max_rounds:
            return True
        if run_dir is not None and ((run_dir / "STOP").exists() or _orphaned()):
            return True
        return read_text(weights_dir, "STOP", options) is not None

    # A round an earlier life started (its first batch is in the store) is finished even if
    # STOP is already there, so every round in the store ends up complete.
    unfinished = _round_started(store, _round_ids(cfg, meta, actor_id, rnd))
    print(
        f"actor {actor_id}: pid {os.getpid()}, backend {backend}, store {store_uri}, weights "
        f"{weights_dir}, starting at round {rnd}"
        + (" (left unfinished by an earlier life)" if unfinished else ""),
        flush=True,
    )
    log_path = (run_dir or state_dir) / "metrics.jsonl"
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
            summary = _generate_round(cfg, store, task, gen, version, actor_id, rnd, meta)
            rnd += 1
            rounds += 1
            unfinished = False
            done_at_version += 1
            _round_done(state_path, log_path, summary, actor_id, rnd, version)
            if shared is not None:
                write_text(shared, f"a{actor_id}.json", json.dumps({"round": rnd}), options)
    finally:
        policy.close()
    return rounds


def _actors_dir(weights_dir: str | Path) -> str | Path:
    """Where the actors' next rounds are kept beside the weights (a folder or a URI)."""
    root = str(weights_dir)
    return f"{root.rstrip('/')}/actors" if is_remote(root) else Path(root) / "actors"


def _next_round(state_path: Path, shared: str | Path | None, actor_id: int, options) -> int:
    """The round this actor starts at: the later of its local record and, with ``shared``,
    the one beside the weights (rounds only move forward)."""
    rnd = int(_read_json(state_path).get("round", 0))
    if shared is not None:
        text = read_text(shared, f"a{actor_id}.json", options)
        rnd = max(rnd, int(json.loads(text)["round"]) if text else 0)
    return rnd


def _round_ids(cfg: TrainConfig, meta: dict[str, Any], actor_id: int, rnd: int) -> RoundIds:
    """Round ``rnd`` of this actor: its seed and ids are functions of (seed, actor, round)."""
    from trainer.run.setup import id_scheme

    run_id = meta["run_id"]
    prefix, time_ms = id_scheme(meta)
    return RoundIds(
        run_id, policy_id=run_id, id_namespace=f"{prefix}/a{actor_id}/r{rnd}",
        id_time_ms=time_ms, seed=actor_seed(cfg.run.seed, actor_id, rnd),
    )  # fmt: skip


def _round_started(store: Any, ids: RoundIds) -> bool:
    """Whether an earlier life of this actor appended the round's first batch."""
    (first,) = ids.rollout_ids(0, 1)
    return store.count(filter=f"rollout_id = '{first}'") > 0


def _round_done(
    state_path: Path, metrics_path: Path, summary, actor_id: int, rnd: int, version: int
) -> None:
    """Round ``rnd - 1`` is in the store: record ``rnd`` as the next one, log and report it."""
    _write_json(state_path, {"round": rnd})
    _log_line(metrics_path, _round_record(summary, actor_id, rnd - 1, version))
    print(
        f"actor {actor_id}: round {rnd - 1} with version {version}: {summary.line()}",
        flush=True,
    )


def _generate_round(cfg, store, task, gen, version: int, actor_id: int, rnd: int, meta):
    """Round ``rnd`` of this actor: prompts, seeds and ids are functions of (seed, actor, round)."""
    g = cfg.generation
    return generate_rollouts(
        store, gen, task, g.prompts_per_round, generation=g, policy_version=version,
        ids=_round_ids(cfg, meta, actor_id, rnd), progress=False,
        on_append=lambda b: actor_crash(actor_id, rnd, b),
    )  # fmt: skip


def _round_record(summary, actor_id: int, rnd: int, version: int) -> dict[str, Any]:
    return {
        "kind": "generate",
        "step": version,  # an actor knows no learner step; version = steps taken
        "time": time.time(),
        "actor": actor_id,
        "round": rnd,
        "policy_version": version,
        "rollouts": summary.rollouts,
        "tokens": summary.tokens,
        "reward": summary.mean_reward,
        "seconds": summary.seconds,
        "store_version": summary.store_version,
        "prompts_truncated": summary.prompts_truncated,
        "prompts_skipped": summary.prompts_skipped,
    }
