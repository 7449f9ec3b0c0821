"""The main job: replay RL on a task, through the rollout store, with exact resume.

    rolloutstore-train train examples/arith.toml
    rolloutstore-train resume runs/arith

Sync mode, one process, top to bottom:

    build or load the model -> optional supervised warm start on task solutions
    repeat until run.steps learner steps (or run.max_generated_tokens generated):
        every y steps: a generation round with the current weights
            (rollouts scored, advantaged, embedded, appended to RUN_DIR/store);
            y = run.updates_per_round, or, with [replay.control] on, chosen anew at each
            round boundary by trainer.control.ReplayController (which may also move the
            replay fresh_fraction; each decision is a "control" metrics record)
        one learner step on a batch the selector draws from the store (the replay buffer)
        metrics -> RUN_DIR/metrics.jsonl and TensorBoard; checkpoints every N steps

Determinism: prompts, sampling seeds and rollout ids of round r are functions of
(run seed, r) (the schedule is explicit (next round step, round) state, checkpointed
with the controller's state, so a variable y keeps this); the loader's draws are
functions of (seed, step, store content); so a run resumed from a checkpoint
regenerates exactly the rollouts the crashed run had not yet appended (batches it
had appended are kept and skipped) and then takes exactly the steps the
uninterrupted run would have taken.

Under ``torchrun --nproc-per-node N`` the same loop runs on N learner ranks (see
:mod:`trainer.run.distributed`): rank 0 generates, appends, logs and checkpoints; every rank
trains on its disjoint share of each step's selection; gradients are all-reduced.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.control import ReplayController
from trainer.errors import RunDirError
from trainer.models.load import check_model_dir
from trainer.rollout.pipeline import generate_rollouts, resolve_backend
from trainer.rollout.policy import LivePolicy
from trainer.rollout.weights import publish_weights
from trainer.run.checkpoint import save_run_checkpoint
from trainer.run.distributed import Dist, batch_view, trace
from trainer.run.distributed import from_env as dist_from_env
from trainer.run.faults import crash_at
from trainer.run.metrics import Metrics
from trainer.run.setup import (
    TrainResult,
    check_world_size,
    evaluate,
    prepare_model,
    run_meta,
    setup_learner,
    store_location,
)

# -- metrics -------------------------------------------------------------------------------


# -- fault injection (tests only) ------------------------------------------------------------


# -- the loop ------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or resume) the sync replay-RL loop described in the module docstring.

    Under torchrun every rank calls this; only rank 0's result carries the evaluations.
    """
    if cfg.model.path != "tiny":
        check_model_dir(cfg.model.path)  # before any run state is written
    if cfg.run.fsdp and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise RunDirError(
            "run.fsdp = true shards the learner across torchrun ranks (sync mode); start with "
            "`torchrun --nproc-per-node N -m trainer ...` or set run.fsdp = false"
        )
    if cfg.run.mode == "async":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RunDirError(
                'run.mode = "async" runs one learner process that starts its actors; '
                "distributed learners (torchrun) run the sync loop only"
            )
        from trainer.run.async_learner import async_train

        return async_train(cfg, resume=resume, progress=progress)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (
        cfg.control.enabled or cfg.run.max_generated_tokens
    ):
        # Both decide round boundaries from rank 0's generation totals and per-rank
        # diagnostics; the ranks would need them broadcast to stay in step.
        raise RunDirError(
            "[replay.control] and run.max_generated_tokens are single-learner features; "
            "under torchrun use a fixed run.updates_per_round and run.steps"
        )
    d = dist_from_env()
    try:
        return _train(cfg, d, resume=resume, progress=progress)
    finally:
        d.close()


def _train(cfg: TrainConfig, d: Dist, *, resume: bool, progress: bool) -> TrainResult:
    from tqdm.auto import tqdm

    g, r = cfg.generation, cfg.run
    if r.batch_size < d.world_size:
        raise RunDirError(
            f"run.batch_size = {r.batch_size} is the global batch, split across "
            f"{d.world_size} learner ranks: use at least one row per rank"
        )
    run_dir = Path(cfg.run.dir)
    store_uri, options = store_location(cfg, run_dir)
    # Rank 0 creates the run folder, model and store; the others open them after the barrier.
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        meta = run_meta(run_dir, cfg, resume)
        model_dir = prepare_model(cfg, run_dir)
        RolloutStore.open(store_uri, storage_options=options)
    d.barrier()
    if not d.is_main:
        meta = json.loads((run_dir / "run.json").read_text())
        model_dir = prepare_model(cfg, run_dir)  # built by rank 0: only resolves the path
    if resume:
        check_world_size(run_dir, d)
    run_id, start_ms = meta["run_id"], meta["start_ms"]
    task = cfg.task.build()
    store = RolloutStore.open(store_uri, storage_options=options)
    backend = resolve_backend(g.backend)

    learner, loader, state = setup_learner(
        cfg, run_dir, run_id, store, task, model_dir, resume, dist=d
    )
    d.barrier()  # rank 0's source imports are in the store before any rank draws
    step, totals = (
        0,
        {"generated_tokens": 0, "generated_rollouts": 0, "gen_seconds": 0.0, "train_seconds": 0.0},
    )
    first_eval = None
    if state is not None:
        step, totals, first_eval = state["step"], state["totals"], state.get("first_eval")
    # The round schedule: round `rnd` is generated when `step` reaches `next_round` (before
    # that step's learner update), then the next one y steps later.
    controller = None
    if cfg.control.enabled:
        controller = ReplayController(
            cfg.control, updates=r.updates_per_round, fresh=cfg.replay.fresh_fraction
        )
    rnd = -(-step // r.updates_per_round)  # checkpoints without a schedule: fixed y
    next_round = rnd * r.updates_per_round
    if state is not None and state.get("schedule") is not None:
        sched = state["schedule"]
        next_round, rnd = sched["next_round_step"], sched["round"]
        if controller is not None and sched.get("control") is not None:
            controller.load_state_dict(sched["control"])
    if controller is not None and controller.fresh != loader.config.fresh_fraction:
        loader.config = replace(loader.config, fresh_fraction=controller.fresh)

    def done() -> bool:
        spent = r.max_generated_tokens and totals["generated_tokens"] >= r.max_generated_tokens
        return step >= r.steps or bool(spent and step == next_round)

    # Rank 0 is the only generator and the only writer of metrics, checkpoints and weights.
    main = d.is_main
    policy = (
        LivePolicy(backend, g, task, model_dir, run_dir / "weights", run_id, seed=cfg.run.seed)
        if main
        else None
    )
    generator = None
    metrics = Metrics(run_dir) if main else None

    def sync_generator() -> None:
        # Every rank calls this: a sharded learner gathers its weights collectively.
        nonlocal generator
        weights = learner.full_weights()
        if not main:
            return
        generator = policy.sync(learner, weights)
        for event in policy.events:  # vLLM: each verified weight update, logged
            metrics.log("weights", step, event)
        policy.events.clear()

    if first_eval is None:
        if cfg.task.eval_prompts:
            sync_generator()
        if main:
            first_eval = evaluate(generator, task, cfg)
            metrics.log("eval", step, {"reward": first_eval, "generated_tokens": 0})
    it = iter(loader)
    bar = tqdm(
        total=r.steps, initial=step, desc="train", unit="step", disable=not (progress and main)
    )
    last_eval = first_eval
    try:
        while not done():
            if step == next_round:
                y = r.updates_per_round
                if controller is not None:
                    if rnd > 0:
                        decision = controller.decide(rnd)
                        metrics.log("control", step, decision.record())
                        if decision.new_fresh != decision.old_fresh:
                            # The selector reads its config when iteration starts: restart
                            # the iterator at the same step (draws are functions of the step).
                            it.close()
                            loader.config = replace(loader.config, fresh_fraction=controller.fresh)
                            loader.load_state_dict(loader.state_dict())
                            it = iter(loader)
                    y = controller.updates
                sync_generator()
                if main:
                    summary = _generation_round(
                        cfg, store, task, generator, learner.policy_version, step, rnd, run_id,
                        start_ms, totals, metrics,
                    )  # fmt: skip
                    if controller is not None:
                        controller.observe_round_reward(summary.mean_reward)
                d.barrier()  # every rank draws from the store version with this round in it
                next_round, rnd = step + y, rnd + 1
            t0 = time.perf_counter()
            batch = next(it)
            m = learner.step(batch)
            totals["train_seconds"] += time.perf_counter() - t0
            step += 1
            trace(d, step, batch, learner)
            view = batch_view(d, batch)  # the global batch's rewards, staleness, run ids
            m.update(
                reward=float(view["rewards"].mean()),
                replay_ratio=(controller.updates if controller else r.updates_per_round)
                * r.batch_size
                / (g.prompts_per_round * g.group_size),
                staleness_hist={
                    int(k): int(v)
                    for k, v in zip(*np.unique(view["staleness"], return_counts=True))
                },
                store_version=int(batch["store_version"]),
                from_earlier_runs=float(np.mean(view["run_ids"] != run_id)),
                learner_ranks=d.world_size,
                **totals,
            )
            if controller is not None:
                controller.observe_step(m)
                m.update(updates_per_round=controller.updates, fresh_fraction=controller.fresh)
            if main:
                metrics.log("train", step, m)
            crash_at(f"step:{step}")
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.2f}", loss=f"{m['loss']:.3f}")
            if (r.eval_every and step % r.eval_every == 0) or done():
                if cfg.task.eval_prompts:
                    sync_generator()
                if main:
                    last_eval = evaluate(generator, task, cfg)
                    metrics.log("eval", step, {"reward": last_eval, **totals})
                    bar.write(f"step {step}: eval reward {last_eval:.3f} (start {first_eval:.3f})")
            if step % r.checkpoint_every == 0 or done():
                if not learner.sharded:  # sharded: one copy of the weights, no replicas
                    d.check_replicas(learner.model)  # also the barrier before rank 0 saves
                learner_state = learner.state_dict()  # sharded: a gather, on every rank
                if main:
                    schedule = {
                        "next_round_step": next_round,
                        "round": rnd,
                        "control": controller.state_dict() if controller is not None else None,
                    }
                    save_run_checkpoint(
                        run_dir, step, cfg, learner, loader, store, totals, first_eval, schedule,
                        learner_state,
                    )  # fmt: skip
        weights = learner.full_weights()  # sharded: a gather, on every rank
        if main:
            publish_weights(
                run_dir / "weights", learner.policy_version, weights, template=model_dir
            )
    finally:
        bar.close()
        if main:
            metrics.close()
            policy.close()
    return TrainResult(run_dir, store_uri, step, first_eval, last_eval)


def _generation_round(
    cfg, store, task, generator, policy_version, step, rnd, run_id, start_ms, totals, metrics
):
    """Round ``rnd`` (due at learner step ``step``): generate with ``generator`` and append."""
    g, r = cfg.generation, cfg.run
    summary = generate_rollouts(
        store,
        model=generator,
        task=task,
        prompts=task.make_prompts(g.prompts_per_round, seed=r.seed * 1_000_003 + rnd),
        policy_version=policy_version,
        backend="hf",
        **g.sampling(seed=r.seed * 1_000_003 + rnd).kwargs(),
        batch_prompts=g.batch_prompts,
        run_id=run_id,
        policy_id=run_id,
        progress=False,
        id_namespace=f"{run_id}/r{rnd}",
        id_time_ms=start_ms,
        on_append=lambda b: crash_at(f"generate:{rnd}:{b}"),
    )
    totals["generated_tokens"] += summary.tokens
    totals["generated_rollouts"] += summary.rollouts
    totals["gen_seconds"] += summary.seconds
    metrics.log(
        "generate",
        step,
        {
            "round": rnd,
            "rollouts": summary.rollouts,
            "tokens": summary.tokens,
            "reward": summary.mean_reward,
            "seconds": summary.seconds,
            "store_version": summary.store_version,
        },
    )
    return summary
