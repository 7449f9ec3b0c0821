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
:mod:`trainer.distributed`): rank 0 generates, appends, logs and checkpoints; every rank
trains on its disjoint share of each step's selection; gradients are all-reduced.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolloutstore import RolloutStore
from rolloutstore.replay.loader import ReplayDataset

from .checkpoint import (
    ResumeStoreView,
    latest_checkpoint,
    newest_good_checkpoint,
    publish_weights,
    remove_abandoned_saves,
    save_checkpoint,
    saved_state,
)
from .config import TrainConfig, configured_location, storage_options_from_env
from .control import ReplayController
from .distributed import Dist, batch_view, shard_learner, trace, wrap_learner
from .distributed import from_env as dist_from_env
from .generate import generate_rollouts
from .learner import Learner
from .tasks import get_task


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    store: str  # URI: a local folder or s3://...
    steps: int
    first_eval: float | None
    last_eval: float | None


class RunDirError(ValueError):
    """The run folder does not fit the request (exists already, or holds nothing to resume)."""


# -- setup ---------------------------------------------------------------------------------
def prepare_model(cfg: TrainConfig, run_dir: Path) -> Path:
    """The initial model folder: built once for ``tiny``, else the configured path."""
    if cfg.model.path != "tiny":
        return Path(cfg.model.path)
    path = run_dir / "model-init"
    if not (path / "config.json").exists():
        from .tiny import make_tiny_model

        tmp = run_dir / ".model-init-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(
            tmp,
            task=cfg.task.name if cfg.task.name in ("arith", "countdown") else "arith",
            seed=cfg.model.seed,
            hidden_size=cfg.model.hidden_size,
            num_layers=cfg.model.num_layers,
            num_heads=cfg.model.hidden_size // 64,
            vocab_size=cfg.model.vocab_size,
        )
        tmp.rename(path)
    return path


def load_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, local_files_only=True
    )
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model.float(), tok


def warm_start(
    model, tokenizer, task, *, steps: int, lr: float, seed: int, batch: int = 32
) -> list[float]:
    """Supervised steps on task solutions so that early rewards are not all zero.

    Prompt and answer are tokenized separately and concatenated, exactly as the
    generator sees them; only answer tokens (and EOS) carry loss.
    """
    torch.manual_seed(seed)
    prompts = task.make_prompts(steps * batch, seed=seed + 7_919)
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for i in range(steps):
        chunk = prompts[i * batch : (i + 1) * batch]
        seqs, labels = [], []
        for p in chunk:
            pi = tokenizer(p.prompt_text, add_special_tokens=False)["input_ids"]
            ai = tokenizer(" " + p.answer, add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(pi + ai)
            labels.append([-100] * len(pi) + ai)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), eos, dtype=torch.long)
        lab = torch.full((len(seqs), width), -100, dtype=torch.long)
        att = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, (s, lb) in enumerate(zip(seqs, labels)):
            ids[j, : len(s)] = torch.tensor(s)
            lab[j, : len(lb)] = torch.tensor(lb)
            att[j, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def evaluate(generator, task, cfg: TrainConfig) -> float:
    """Mean reward on held-out prompts (one sample each, training temperature, fixed seed)."""
    n = cfg.task.eval_prompts
    if n == 0:
        return float("nan")
    prompts = task.make_prompts(n, seed=10_000_019 + cfg.run.seed)
    g = cfg.generation
    rows = generator.generate(
        [p.prompt_text for p in prompts],
        group_size=1,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_tokens=g.max_tokens,
        seed=cfg.run.seed + 99,
    )
    return float(
        np.mean([task.reward(p, r["completion_text"]).reward for p, r in zip(prompts, rows)])
    )


# -- metrics -------------------------------------------------------------------------------
class Metrics:
    """Appends one JSON line per event to RUN_DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboard is a dependency; keep going without it if absent
            pass

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        rec = {"kind": kind, "step": step, "time": time.time(), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=_jsonable) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _jsonable(v):
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return str(v)


def save_run_checkpoint(
    run_dir: Path,
    step: int,
    cfg: TrainConfig,
    learner: Learner,
    loader,
    store,
    totals,
    first_eval,
    schedule: dict[str, Any] | None = None,
    learner_state: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint everything a resume needs: learner state, loader position, store version,
    and (sync loop) the round schedule with the replay controller's state.

    ``learner_state``: ``learner.state_dict()`` gathered beforehand (FSDP: on every rank)."""
    if learner_state is None:
        learner_state = learner.state_dict()
    return save_checkpoint(
        run_dir,
        step,
        model=learner_state["model"],
        trainer_state={"learner": learner_state},
        state={
            "policy_version": learner.policy_version,
            "loader": loader.state_dict(),
            # Issue 20: the version the loader reads (a resumed run catching up: a snapshot).
            "store_version": loader.store.version,
            "totals": totals,
            "first_eval": first_eval,
            "config": cfg.to_dict(),
            **({"schedule": schedule} if schedule is not None else {}),
        },
        keep=cfg.run.keep_checkpoints,
    )


def store_location(cfg: TrainConfig, run_dir: Path) -> tuple[str, dict[str, str] | None]:
    """The run's store URI and storage options: [run] store, $ROLLOUTSTORE_STORE_URI, or
    RUN_DIR/store; options from $ROLLOUTSTORE_STORAGE_OPTIONS (credentials stay out of configs)."""
    uri = configured_location(cfg, "store") or str(run_dir / "store")
    return uri, storage_options_from_env()


def resolve_backend(name: str) -> str:
    """``auto`` is vLLM when it is installed, else transformers."""
    if name != "auto":
        return name
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


class LivePolicy:
    """The sync loop's generator, kept at the learner's current weights.

    transformers: one model, the learner's state dict copied in. vLLM: the first
    version is published as a model folder and the engine started from it; later
    versions go from the learner's state dict into the running engine (no folder,
    no restart), and each is verified against a teacher-forced recomputation of the
    new weights. A failed check is logged and falls back to publishing the version
    and restarting the engine from it (see _VLLMPolicy in trainer/async_train.py).
    """

    def __init__(self, backend: str, cfg: TrainConfig, model_dir: Path, run_dir: Path, run_id: str):
        self.backend, self.cfg, self.model_dir, self.run_dir = backend, cfg, model_dir, run_dir
        self.run_id = run_id
        self.gen = None
        self.version: int | None = None
        self.events: list[dict] = []  # vLLM: one per new version (verification and how loaded)
        if backend == "hf":
            from .hf_generate import HFGenerator

            self.gen = HFGenerator(model_dir, policy_version=0, policy_id=run_id)
        else:
            from .async_train import _VLLMPolicy

            # Quiet: one line per generation round would drown the progress bar; a
            # failed verification (and its restart) is still printed.
            self.vllm = _VLLMPolicy(cfg, run_id, seed=cfg.run.seed, verbose=False)

    def sync(self, learner: Learner, weights: dict[str, Any] | None = None):
        """The generator at the learner's weights (``weights``: its gathered state dict)."""
        v = learner.policy_version
        if weights is None:
            weights = learner.model.state_dict()
        if self.backend == "hf":
            self.gen.model.load_state_dict(weights)
            self.gen.policy_version = v
        elif self.version != v:

            def publish() -> Path:
                return publish_weights(
                    self.run_dir / "weights", v, weights, template=self.model_dir
                )

            self.gen = self.vllm.update(v, weights, publish)
            self.events.append(
                {
                    "policy_version": v,
                    "max_logprob_gap": self.vllm.last_gap,
                    "engine_starts": self.vllm.restarts,
                    "in_place_updates": self.vllm.in_place,
                }
            )
        self.version = v
        return self.gen

    def close(self) -> None:
        if self.backend != "hf":
            self.vllm.close()


def setup_learner(
    cfg: TrainConfig,
    run_dir: Path,
    run_id: str,
    store: RolloutStore,
    task,
    model_dir: Path,
    resume: bool,
    dist: Dist | None = None,
) -> tuple[Learner, ReplayDataset, dict | None]:
    """The learner and its replay loader, shared by the sync and async loops.

    Imports ``[run].sources`` (idempotent; rank 0 only), then either restores the newest
    checkpoint (returned as its state dict) or warm-starts the fresh model. With ``dist``
    the loader yields this rank's share of each step and the learner is DDP-wrapped (or,
    with ``run.fsdp``, sharded before the restore, which then re-shards the full checkpoint).
    """
    g, r = cfg.generation, cfg.run
    d = dist or Dist()
    model, tokenizer = load_model(model_dir)
    if r.sources and d.is_main:
        from .reuse import import_sources
        from .tiny import tokenizer_fingerprint

        for imp in import_sources(
            store, r.sources, run_id=run_id, fingerprint=tokenizer_fingerprint(tokenizer)
        ):
            print(
                f"replaying {imp['rollouts']} rollouts of run {imp['run_id']!r} from "
                f"{imp['source']} (its version {imp['parent_version']} -> this run's -1)"
            )
    ckpt = None
    if resume:  # issue 20: the newest undamaged checkpoint (damaged newer ones: a warning each)
        ckpt = newest_good_checkpoint(run_dir, warn=None if d.is_main else lambda _line: None)
    if ckpt is None and r.warm_start_steps:
        warm_start(
            model, tokenizer, task, steps=r.warm_start_steps, lr=r.warm_start_lr, seed=r.seed
        )
    learner = Learner(
        model,
        cfg.loss,
        cfg.optim,
        temperature=g.temperature,
        top_k=g.top_k or None,
        top_p=g.top_p if g.top_p < 1 else None,
        compute_entropy=True,
        device=d.device,
    )
    loader = ReplayDataset(
        store,
        cfg.replay,
        batch_size=r.batch_size,
        max_tokens_per_batch=r.max_tokens_per_batch or None,
        pack=r.pack,
        run_id=run_id,
        prefetch=0,  # the learner version must be read when each batch is drawn
        learner_version=lambda _s: learner.policy_version,
        rank=d.rank,
        world_size=d.world_size,
    )
    if r.fsdp:
        shard_learner(learner, d)
    state = None
    if ckpt is not None:
        trainer_state, state = ckpt.restore(None if r.fsdp else learner.model)
        learner.load_state_dict(trainer_state["learner"])
        loader.load_state_dict(state["loader"])
    if not r.fsdp:
        wrap_learner(learner, d)
    return learner, loader, state


# -- fault injection (tests only) ------------------------------------------------------------
def _fault(where: str) -> None:
    """SIGKILL this process when ROLLOUTSTORE_FAULT names ``where`` (crash-safety tests).

    Under torchrun, ROLLOUTSTORE_FAULT_RANK=R limits the fault to rank R.
    """
    import os
    import signal

    if os.environ.get("ROLLOUTSTORE_FAULT") != where:
        return
    only = os.environ.get("ROLLOUTSTORE_FAULT_RANK")
    if only is None or only == os.environ.get("RANK", "0"):
        os.kill(os.getpid(), signal.SIGKILL)


# -- the loop ------------------------------------------------------------------------------
def _run_meta(run_dir: Path, cfg: TrainConfig, resume: bool) -> dict[str, Any]:
    meta_path = run_dir / "run.json"
    remove_abandoned_saves(run_dir)  # issue 20: .tmp-step-* folders of saves a kill cut short
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if not resume and latest_checkpoint(run_dir) is not None:
            raise RunDirError(
                f"{run_dir} already holds a run; continue it with `rolloutstore-train resume "
                f"{run_dir}` or choose another [run].dir"
            )
        if resume:
            return meta
    elif resume:
        raise RunDirError(f"{run_dir} holds no run to resume (no run.json)")
    start_ms = cfg.run.id_time_ms or time.time_ns() // 1_000_000
    meta = {"run_id": cfg.run_id, "start_ms": start_ms, "config": cfg.to_dict()}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


def _check_world_size(run_dir: Path, d: Dist) -> None:
    """Refuse to resume a run with a different number of learner ranks than wrote it."""
    found = saved_state(run_dir)  # issue 20: the newest readable state.json (skips damaged)
    if found is None:
        return
    ckpt, state = found
    saved = state.get("loader", {}).get("world_size", 1)
    if saved != d.world_size:
        how = (
            f"torchrun --nproc-per-node {saved} -m trainer resume {run_dir}"
            if saved > 1
            else f"rolloutstore-train resume {run_dir}"
        )
        raise RunDirError(
            f"{ckpt} was written by {saved} learner rank(s), this resume has {d.world_size}: "
            f"each step's draw is split across ranks, so only the same count continues the "
            f"same run; resume with `{how}`"
        )


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Run (or resume) the sync replay-RL loop described in the module docstring.

    Under torchrun every rank calls this; only rank 0's result carries the evaluations.
    """
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
        from .async_train import async_train

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
        meta = _run_meta(run_dir, cfg, resume)
        model_dir = prepare_model(cfg, run_dir)
        RolloutStore.open(store_uri, storage_options=options)
    d.barrier()
    if not d.is_main:
        meta = json.loads((run_dir / "run.json").read_text())
        model_dir = prepare_model(cfg, run_dir)  # built by rank 0: only resolves the path
    if resume:
        _check_world_size(run_dir, d)
    run_id, start_ms = meta["run_id"], meta["start_ms"]
    task = get_task(cfg.task.name, **cfg.task.options)
    store = RolloutStore.open(store_uri, storage_options=options)
    backend = resolve_backend(g.backend)

    learner, loader, state = setup_learner(
        cfg, run_dir, run_id, store, task, model_dir, resume, dist=d
    )
    d.barrier()  # rank 0's source imports are in the store before any rank draws
    # Issue 20: draw from the store as the uninterrupted run did (see ResumeStoreView).
    store_view = ResumeStoreView(store, run_id, state)
    loader.store = store_view.store
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
    policy = LivePolicy(backend, cfg, model_dir, run_dir, run_id) if main else None
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
                if store_view.after_round(learner.policy_version):
                    # Issue 20, resume catching up: the snapshot moved on to just after this round.
                    it.close()
                    loader.store = store_view.store
                    loader.load_state_dict(loader.state_dict())
                    it = iter(loader)
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
            _fault(f"step:{step}")
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
        group_size=g.group_size,
        policy_version=policy_version,
        backend="hf",
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        max_tokens=g.max_tokens,
        seed=r.seed * 1_000_003 + rnd,
        batch_prompts=g.batch_prompts,
        run_id=run_id,
        policy_id=run_id,
        progress=False,
        id_namespace=f"{run_id}/r{rnd}",
        id_time_ms=start_ms,
        on_append=lambda b: _fault(f"generate:{rnd}:{b}"),
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
