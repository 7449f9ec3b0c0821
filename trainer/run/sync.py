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
from typing import Any

import numpy as np
import torch

from rolloutstore import RolloutStore
from rolloutstore.replay.budget import budget_metrics
from trainer.config import TrainConfig, process_threads
from trainer.control import ReplayController
from trainer.errors import RunDirError
from trainer.models.lora import has_lora
from trainer.rollout.evaluation import EvalResult
from trainer.rollout.pipeline import RoundIds, generate_rollouts, resolve_backend
from trainer.rollout.policy import LivePolicy
from trainer.rollout.vllm_env import ENGINE_LOG
from trainer.run.checkpoint import save_run_checkpoint
from trainer.run.distributed import Dist, batch_view, trace
from trainer.run.distributed import from_env as dist_from_env
from trainer.run.faults import crash_at
from trainer.run.loop import Loop
from trainer.run.metrics import Metrics
from trainer.run.resume import check_resume, check_resume_store
from trainer.run.setup import (
    TrainResult,
    check_start,
    check_twin_ids,
    check_world_size,
    evaluate,
    id_scheme,
    prepare_model,
    removed_on_failure,
    report_sources,
    run_meta,
    run_publisher,
    setup_learner,
    store_location,
)
from trainer.run.store_view import ResumeStoreView


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or resume) the sync replay-RL loop described in the module docstring.

    Under torchrun every rank calls this; only rank 0's result carries the evaluations.
    """
    if resume:  # [optim] / [model] changes a resume cannot apply: refused, nothing written
        check_resume(cfg)
        check_resume_store(cfg.run.dir, *store_location(cfg, Path(cfg.run.dir)))
    check_start(cfg)  # model, task, sources: refused before any run state is written
    torch.set_num_threads(process_threads(cfg.run))  # the learner and in-process generators
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
        with removed_on_failure(Path(cfg.run.dir), resume=resume, main=d.is_main):
            loop = SyncLoop(cfg, d, resume=resume)
        return loop.run(progress=progress)
    finally:
        d.close()


class SyncLoop(Loop):
    """The sync loop of one run on one learner rank: ``SyncLoop(cfg, dist, resume=...).run()``.

    Setup (run folder, model, store, learner, loader) happens in ``__init__``; ``run`` is
    :meth:`trainer.run.loop.Loop.run`: a generation round before each step the schedule says
    (:meth:`before_step`), the final weights published at the end. :meth:`state_dict` is the
    loop's own state a checkpoint holds (the step, generation totals, the first evaluation,
    and the round schedule with the replay controller's state); the learner and loader
    checkpoint theirs.
    """

    def __init__(self, cfg: TrainConfig, d: Dist, *, resume: bool):
        self.t0 = time.perf_counter()  # startup_seconds count from here (trainer.run.loop)
        r = cfg.run
        if r.batch_size < d.world_size:
            raise RunDirError(
                f"run.batch_size = {r.batch_size} is the global batch, split across "
                f"{d.world_size} learner ranks: use at least one row per rank"
            )
        self.cfg, self.d, self.main = cfg, d, d.is_main
        self.run_dir = run_dir = Path(r.dir)
        self.store_uri, options = store_location(cfg, run_dir)
        # Rank 0 creates the run folder, model and store; the others open them after the barrier.
        if d.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            meta = run_meta(run_dir, cfg, resume)
            self.model_dir = prepare_model(cfg, run_dir)
            RolloutStore.open(self.store_uri, storage_options=options)
        d.barrier()
        if not d.is_main:
            meta = json.loads((run_dir / "run.json").read_text())
            self.model_dir = prepare_model(cfg, run_dir)  # built by rank 0: resolves the path
        if resume:
            check_world_size(run_dir, d)
        self.run_id = meta["run_id"]
        self.id_prefix, self.id_time_ms = id_scheme(meta)  # seeded: not the folder, nor the clock
        self.task = cfg.task.build()
        self.store = RolloutStore.open(self.store_uri, storage_options=options)
        self.learner, self.loader, state = setup_learner(
            cfg, run_dir, self.run_id, self.store, self.task, self.model_dir, resume, dist=d
        )
        if state is None and d.is_main:  # a twin's rows in a shared store: refused, not reused
            check_twin_ids(self.store, self.run_id, self._round_ids(0).rollout_ids(0, 1)[0])
        d.barrier()  # rank 0's source imports are in the store before any rank draws
        # Draw from the store as the uninterrupted run did (see trainer.run.store_view).
        self.store_view = ResumeStoreView(self.store, self.run_id, state)
        self.loader.retarget(store=self.store_view.store)
        self.controller = None
        if cfg.control.enabled:
            self.controller = ReplayController(
                cfg.control, updates=r.updates_per_round, fresh=cfg.replay.fresh_fraction
            )
        self.load_state_dict(state or {})
        fresh = self.controller.fresh if self.controller is not None else None
        if fresh is not None and fresh != cfg.replay.fresh_fraction:
            self.loader.retarget(config=replace(cfg.replay, fresh_fraction=fresh))
        # Rank 0 is the only generator and the only writer of metrics, checkpoints, weights.
        self.policy = self.metrics = self.generator = None
        self.synced_version: int | None = None  # the learner version the generator holds
        if self.main:
            backend = resolve_backend(cfg.generation.backend)
            self.policy = LivePolicy(
                backend, cfg.generation, self.task, self.model_dir, run_dir / "weights",
                self.run_id, seed=r.seed, trust_remote_code=cfg.model.trust_remote_code,
                publisher=run_publisher(cfg, run_dir, self.learner.device),
                threads=process_threads(r), engine_log=run_dir / ENGINE_LOG,
            )  # fmt: skip
            self.metrics = Metrics(run_dir, state)  # records after the checkpoint dropped
            if state is None:  # from step 0: what the imported rows give this run
                report_sources(cfg, self.store, self.run_id, self.metrics)
        self.last_eval = self.first_eval

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "totals": self.totals,
            "first_eval": self.first_eval,
            "schedule": {
                "next_round_step": self.next_round,
                "round": self.rnd,
                "control": self.controller.state_dict() if self.controller else None,
                "policy_reward": self.policy_reward,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The loop's part of a checkpoint's ``state.json`` ({} on a fresh run)."""
        upr = self.cfg.run.updates_per_round
        self.step = state.get("step", 0)
        self.totals = state.get("totals") or {
            "generated_tokens": 0, "generated_rollouts": 0, "gen_seconds": 0.0,
            "train_seconds": 0.0, "sync_seconds": 0.0, "eval_seconds": 0.0,
        }  # fmt: skip
        self.first_eval = state.get("first_eval")
        # The round schedule: round `rnd` is generated when `step` reaches `next_round`
        # (before that step's learner update), then the next one y steps later.
        self.rnd = -(-self.step // upr)  # checkpoints without a schedule: fixed y
        self.next_round = self.rnd * upr
        sched = state.get("schedule")
        # The newest round's mean reward: the policy's own, beside the replayed batch's (a
        # resume restores it, so records before the next round carry it as the run's did).
        self.policy_reward: float | None = (sched or {}).get("policy_reward")
        if sched is not None:
            self.next_round, self.rnd = sched["next_round_step"], sched["round"]
            if self.controller is not None and sched.get("control") is not None:
                self.controller.load_state_dict(sched["control"])

    # -- the loop's own steps (trainer.run.loop.Loop.run reads top to bottom) ---------------
    def _round_ids(self, rnd: int) -> RoundIds:
        """Round ``rnd``'s prompts, sampling seeds and rollout ids: functions of (seed, config,
        round) under seeded ids ([run].ids), so twin runs in two folders write the same rows."""
        return RoundIds(
            self.run_id, policy_id=self.run_id, id_namespace=f"{self.id_prefix}/r{rnd}",
            id_time_ms=self.id_time_ms, seed=self.cfg.run.seed * 1_000_003 + rnd,
        )  # fmt: skip

    def done(self) -> bool:
        r = self.cfg.run
        budget = r.max_generated_tokens
        spent = budget and self.totals["generated_tokens"] >= budget
        return self.step >= r.steps or bool(spent and self.step == self.next_round)

    def before_step(self) -> None:
        if self.step == self.next_round:
            self._round()

    def _sync_generator(self) -> None:
        """The generator brought to the learner's weights; its time in ``sync_seconds`` (the
        first: building the generator or starting the engine, in ``startup_seconds``) and a
        ``sync`` record per update with its parts."""
        version = self.learner.policy_version  # the same on every rank
        if self.synced_version == version:
            return  # already there: a round right after an eval at the same step
        self.synced_version = version
        first = self.generator is None
        t0 = time.perf_counter()
        # Every rank calls this: a sharded learner gathers its weights collectively.
        weights = self.learner.full_weights()  # with LoRA: merged into the base weights
        t1 = time.perf_counter()
        if not self.main:
            return
        self.generator = self.policy.sync(self.learner, weights)
        t2 = time.perf_counter()
        self.totals["startup_seconds" if first else "sync_seconds"] += t2 - t0
        rec = {
            "policy_version": version, "seconds": t2 - t0,
            "gather_seconds": t1 - t0, "load_seconds": t2 - t1, "first": first,
        }  # fmt: skip
        for event in self.policy.events:  # vLLM: each verified weight update, logged
            rec.update({k: v for k, v in event.items() if k.endswith("_seconds")})
            self.metrics.log("weights", self.step, event)
        self.policy.events.clear()
        self.metrics.log("sync", self.step, rec)

    def _round(self) -> None:
        """Round ``rnd``, due now: y for the next rounds, the generator synced, rows appended."""
        y, ctl = self.cfg.run.updates_per_round, self.controller
        if ctl is not None:
            if self.rnd > 0:
                decision = ctl.decide(self.rnd)
                self.metrics.log("control", self.step, decision.record())
                if decision.new_fresh != decision.old_fresh:
                    self.loader.retarget(config=replace(self.cfg.replay, fresh_fraction=ctl.fresh))
                    self.it = self.loader.restart(self.it)
            y = ctl.updates
        self._sync_generator()
        if self.main:
            summary = _generation_round(
                self.cfg, self.store, self.task, self.generator, self.learner.policy_version,
                self.step, self.rnd, self._round_ids(self.rnd), self.totals, self.metrics,
            )  # fmt: skip
            self.policy_reward = summary.mean_reward
            if ctl is not None:
                ctl.observe_round_reward(summary.mean_reward)
        self.d.barrier()  # every rank draws from the store version with this round in it
        if self.store_view.after_round(self.learner.policy_version):
            # Resume catching up: the snapshot moved on to just after this round.
            self.loader.retarget(store=self.store_view.store)
            self.it = self.loader.restart(self.it)
        self.next_round, self.rnd = self.step + y, self.rnd + 1

    def after_step(self, m: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
        """The step's train record: the global batch's, the totals, the controller's knobs."""
        g, r, ctl = self.cfg.generation, self.cfg.run, self.controller
        trace(self.d, self.step, batch, self.learner)
        view = batch_view(self.d, batch)  # the global batch's rewards, staleness, run ids
        y = ctl.updates if ctl else r.updates_per_round
        stale = np.unique(view["staleness"], return_counts=True)
        m.update(
            reward=float(view["rewards"].mean()),
            replay_ratio=y * r.batch_size / (g.prompts_per_round * g.group_size),
            staleness_hist={int(k): int(v) for k, v in zip(*stale)},
            store_version=int(batch["store_version"]),
            from_earlier_runs=float(np.mean(view["run_ids"] != self.run_id)),
            learner_ranks=self.d.world_size,
            **self.totals,
        )
        if self.policy_reward is not None:  # None before the run's first round
            m["policy_reward"] = float(self.policy_reward)
        if batch.get("no_embedding") is not None:  # diversity="embedding": rows it fell back on
            m["no_embedding"] = int(batch["no_embedding"])
        m.update(budget_metrics(batch))  # rows trained, and what [run].max_tokens_per_batch cut
        if ctl is not None:
            ctl.observe_step(m)
            m.update(updates_per_round=ctl.updates, fresh_fraction=ctl.fresh)
        return m

    def evaluate(self) -> EvalResult | None:
        if self.cfg.eval.prompts:
            self._sync_generator()
        return evaluate(self.generator, self.task, self.cfg) if self.main else None

    def checkpoint(self) -> None:
        learner, d = self.learner, self.d
        if not learner.sharded:  # sharded: one copy of the weights, no replicas
            d.check_replicas(learner.model)  # also the barrier before rank 0 saves
        learner_state = learner.state_dict()  # sharded: a gather, on every rank
        if self.main:
            save_run_checkpoint(
                self.run_dir, self.step, self.cfg, learner, self.loader, self.store,
                self.totals, self.first_eval, self.state_dict()["schedule"], learner_state,
                metrics_records=self.metrics.records,
            )  # fmt: skip

    def finish(self) -> None:
        weights = self.learner.full_weights()  # sharded: a gather, on every rank
        if self.main:
            learner = self.learner  # LoRA: its adapters (sharded: the merged weights)
            source = learner.model if has_lora(learner.model) and not learner.sharded else weights
            self.policy.publisher.publish(
                self.run_dir / "weights", learner.policy_version, source, self.model_dir
            )

    def close(self) -> None:
        if self.main:
            self.metrics.close()
            self.policy.close()


def _generation_round(cfg, store, task, generator, policy_version, step, rnd, ids, totals, metrics):
    """Round ``rnd`` (due at learner step ``step``): generate with ``generator`` and append."""
    g = cfg.generation
    summary = generate_rollouts(
        store, generator, task, g.prompts_per_round, generation=g, policy_version=policy_version,
        ids=ids, progress=False, on_append=lambda b: crash_at(f"generate:{rnd}:{b}"),
    )  # fmt: skip
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
            "prompts_truncated": summary.prompts_truncated,
            "prompts_skipped": summary.prompts_skipped,
        },
    )
    return summary
