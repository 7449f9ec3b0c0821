"""What the sync and async loops share: run folder bookkeeping, warm start, evaluation,
the store location and the learner with its replay loader (restored from a checkpoint)."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rolloutstore import RolloutStore
from rolloutstore.replay.loader import ReplayDataset
from trainer.algo.learner import Learner
from trainer.algo.loss_config import LossConfig
from trainer.config import TrainConfig, configured_location, storage_options_from_env
from trainer.errors import ConfigError, RunDirError
from trainer.models.load import check_model_dir, load_model, resolve_device, resolve_dtype
from trainer.models.lora import apply_lora
from trainer.rollout.evaluation import EvalResult
from trainer.rollout.evaluation import evaluate as run_eval
from trainer.rollout.weights import Publisher
from trainer.run.checkpoint import (
    latest_checkpoint,
    newest_good_checkpoint,
    remove_abandoned_saves,
    saved_state,
)
from trainer.run.distributed import Dist, shard_learner, wrap_learner
from trainer.run.resume import note_resume, read_run_meta
from trainer.tasks.chat import render_prompts


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    store: str  # URI: a local folder or s3://...
    steps: int
    first_eval: float | None
    last_eval: float | None
    timing: dict[str, float] | None = None  # rank 0: the run's time accounting (loop.py)


def warm_start(
    model, tokenizer, task, *, steps: int, lr: float, seed: int, batch: int = 32
) -> list[float]:
    """Supervised steps on task solutions so that early rewards are not all zero.

    Prompt (chat-rendered as the generator sees it) and answer are tokenized separately and
    concatenated; only answer tokens (and EOS) carry loss. Only trainable parameters move (with
    LoRA: the adapters). A task with tools gives its own
    demonstrations (``task.demonstration``, trainer/tasks/tools.py): each segment tokenized on
    its own, as multi-turn generation does, and tool output carries no loss.
    """
    torch.manual_seed(seed)
    prompts = render_prompts(
        tokenizer, task.make_prompts(steps * batch, seed=seed + 7_919), task.chat_template
    )
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for i in range(steps):
        chunk = prompts[i * batch : (i + 1) * batch]
        seqs, labels = [], []
        for p in chunk:
            pi = tokenizer(p.prompt_text, add_special_tokens=False)["input_ids"]
            demo = getattr(task, "demonstration", None)
            parts = demo(p) if demo is not None else [(" " + p.answer, True)]
            seq, lab = list(pi), [-100] * len(pi)
            for k, (text, learned) in enumerate(parts):
                seg = tokenizer(text, add_special_tokens=False)["input_ids"]
                seg = seg + [eos] if k == len(parts) - 1 else seg
                seq += seg
                lab += seg if learned else [-100] * len(seg)
            seqs.append(seq)
            labels.append(lab)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), eos, dtype=torch.long)
        lab = torch.full((len(seqs), width), -100, dtype=torch.long)
        att = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, (s, lb) in enumerate(zip(seqs, labels)):
            ids[j, : len(s)] = torch.tensor(s)
            lab[j, : len(lb)] = torch.tensor(lb)
            att[j, : len(s)] = 1
        dev = next(model.parameters()).device
        loss = model(input_ids=ids.to(dev), attention_mask=att.to(dev), labels=lab.to(dev)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def evaluate(generator, task, cfg: TrainConfig) -> EvalResult | None:
    """The held-out evaluation ``[eval]`` configures (None with ``[eval].prompts = 0``): the
    task's eval split rendered as in generation, the same prompts and seeds at every eval."""
    if cfg.eval.prompts == 0:
        return None
    return run_eval(generator, task, cfg.eval, cfg.generation, cfg.run.seed)


def store_location(cfg: TrainConfig, run_dir: Path) -> tuple[str, dict[str, str] | None]:
    """The run's store URI and storage options: [run] store, $ROLLOUTSTORE_STORE_URI, or
    RUN_DIR/store; options from $ROLLOUTSTORE_STORAGE_OPTIONS (credentials stay out of configs)."""
    uri = configured_location(cfg, "store") or str(run_dir / "store")
    return uri, storage_options_from_env()


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
    With ``[model.lora]`` the model carries peft adapters before the warm start, so both the
    warm start and the learner train only them. A resume is recorded in run.json and named in
    one printed line (:func:`trainer.run.resume.note_resume`).
    """
    r = cfg.run
    d = dist or Dist()
    # torchrun ranks: cuda:LOCAL_RANK (or the CPU); one process: [model].device.
    device = d.device if d.enabled else resolve_device(cfg.model.device)
    model, tokenizer = load_learner_model(cfg, model_dir)
    if d.is_main and cfg.store.logprob_precision > store.logprob_precision:
        store.set_logprob_precision(cfg.store.logprob_precision)
    if r.sources and d.is_main:
        _import_sources(store, r.sources, run_id, tokenizer)
    check_logprob_precision(store, cfg)
    ckpt = None
    if resume:  # the newest undamaged checkpoint (damaged newer ones: one warning line each)
        ckpt = newest_good_checkpoint(run_dir, warn=None if d.is_main else lambda _line: None)
    model.to(device)  # the warm start runs where the learner will
    if ckpt is None and r.warm_start_steps:
        warm_start(
            model, tokenizer, task, steps=r.warm_start_steps, lr=r.warm_start_lr, seed=r.seed
        )
    learner = build_learner(cfg, model, device)
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
    if resume:  # steps the killed run drew are in the usage log once; retaking them adds none
        loader.usage_recorded_through = recorded_usage_through(store, run_id)
    if resume and d.is_main:
        note_resume(run_dir, cfg, ckpt)  # run.json's record, one line naming the checkpoint
    if not r.fsdp:
        wrap_learner(learner, d)
    return learner, loader, state


def recorded_usage_through(store: RolloutStore, run_id: str) -> int:
    """The newest learner step of ``run_id`` in the store's usage log (-1: none)."""
    t = store.sql("SELECT max(learner_step) AS s FROM usage WHERE run_id = ?", [run_id])
    value = t["s"][0].as_py()
    return -1 if value is None else int(value)


def load_learner_model(cfg: TrainConfig, model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of ``model_dir`` in float32 master weights (the model runs under
    autocast in [model].dtype, models/load.py), with ``[model.lora]`` adapters when set."""
    mc = cfg.model
    model, tokenizer = load_model(
        model_dir,
        dtype=torch.float32,
        attn_implementation=mc.attn_implementation,
        trust_remote_code=mc.trust_remote_code,
    )
    if mc.lora is not None:
        model = apply_lora(model, mc.lora, seed=cfg.run.seed)
    return model, tokenizer


def check_logprob_precision(store: RolloutStore, cfg: TrainConfig) -> None:
    """Refuse a store whose log-probs are coarser than the loss tolerates, or than the run
    asks for (a store's bound is never lowered; rolloutstore.store.precision)."""
    recorded = store.logprob_precision
    if recorded > cfg.loss.logprob_tolerance:
        raise ConfigError(
            f"store {store.uri} keeps behaviour log-probs to within {recorded:g} nats, more "
            f"than the loss tolerates ([loss].logprob_tolerance = "
            f"{cfg.loss.logprob_tolerance:g}): ratios pi / mu could be off by a factor "
            f"exp({recorded:g}); raise the tolerance or train from a store with a tighter bound"
        )
    if recorded > cfg.store.logprob_precision:
        raise ConfigError(
            f"store {store.uri} keeps behaviour log-probs to within {recorded:g} nats, but "
            f"[store].logprob_precision = {cfg.store.logprob_precision:g}: a store's bound is "
            f"never lowered; set [store].logprob_precision = {recorded:g} or use a new store"
        )


def _import_sources(store: RolloutStore, sources, run_id: str, tokenizer) -> None:
    from trainer.models.tokenizer import tokenizer_fingerprint
    from trainer.run.sources import import_sources

    fingerprint = tokenizer_fingerprint(tokenizer)
    for imp in import_sources(store, sources, run_id=run_id, fingerprint=fingerprint):
        via = f"run {imp['via']!r}'s" if imp.get("via") else "its"
        print(
            f"replaying {imp['rollouts']} rollouts of run {imp['run_id']!r} from "
            f"{imp['source']} ({via} version {imp['parent_version']} -> this run's -1)"
        )


def report_sources(cfg: TrainConfig, store: RolloutStore, run_id: str, metrics) -> None:
    """A run with ``[run] sources``, at its start: one line and a ``sources`` metrics record
    saying how many imported rows its staleness bound lets it draw, and until which step."""
    from trainer.run.sources import source_usage, source_usage_line

    if not cfg.run.sources:
        return
    rep = source_usage(store, run_id, cfg.replay.max_staleness, cfg.run.steps)
    if rep is not None:
        print(source_usage_line(rep), flush=True)
        metrics.log("sources", 0, rep)


def learner_loss_config(cfg: TrainConfig) -> LossConfig:
    """``[loss]`` with Dr. GRPO's constant normaliser filled in when unset: the generation's
    budget of model tokens per trajectory (``max_tokens``; multi-turn: ``max_turns x
    max_tokens`` within ``max_total_tokens``)."""
    loss = cfg.loss
    if loss.agg == "seq-mean-token-sum-norm" and loss.agg_norm_len is None:
        loss = replace(loss, agg_norm_len=cfg.generation.model_token_budget())
    return loss


def build_learner(cfg: TrainConfig, model, device: torch.device) -> Learner:
    """The learner over ``model`` with the run's loss, optimizer and sampling settings."""
    g, mc = cfg.generation, cfg.model
    return Learner(
        model,
        learner_loss_config(cfg),
        cfg.optim,
        temperature=g.temperature,
        top_k=g.top_k,  # None when off, in the config as at the learner
        top_p=g.top_p,
        compute_entropy=True,
        device=device,
        compute_dtype=resolve_dtype(mc.dtype, device),
        gradient_checkpointing=mc.gradient_checkpointing,
    )


def check_start(cfg: TrainConfig) -> None:
    """The config's files and names, checked before anything is created (each refusal one
    line naming the key and the fix): the model folder, device and dtype, the task (its name,
    options and files) and the replay sources."""
    from trainer.models.load import check_model
    from trainer.run.sources import check_sources

    check_model(cfg.model)
    cfg.task.build()
    check_sources(cfg.run.sources, cfg.model.path)


@contextlib.contextmanager
def removed_on_failure(run_dir: Path, *, resume: bool, main: bool = True) -> Iterator[None]:
    """Around a run's setup: a fresh run's folder that this start created is removed again
    when the setup fails (a failed start leaves no half-made run behind)."""
    fresh = main and not resume and not run_dir.exists()
    try:
        yield
    except BaseException:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def run_meta(run_dir: Path, cfg: TrainConfig, resume: bool) -> dict[str, Any]:
    meta_path = run_dir / "run.json"
    remove_abandoned_saves(run_dir)  # .tmp-step-* folders of saves a kill cut short
    if resume:
        return read_run_meta(run_dir)
    if meta_path.exists() and latest_checkpoint(run_dir) is not None:
        raise RunDirError(
            f"{run_dir} already holds a run; continue it with `rolloutstore-train resume "
            f"{run_dir}` or choose another [run].dir"
        )
    start_ms = time.time_ns() // 1_000_000
    if cfg.run.ids == "clock":
        ids = {"mode": "clock", "prefix": cfg.run_id, "time_ms": cfg.run.id_time_ms or start_ms}
    else:
        ids = {"mode": "seeded", "prefix": seeded_id_prefix(cfg), "time_ms": cfg.run.id_time_ms}
    meta = {"run_id": cfg.run_id, "start_ms": start_ms, "ids": ids, "config": cfg.to_dict()}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


# [run] keys that change no generated row: where the run lives, how its ids are made, how
# often it saves, where it stops (run.steps reaches the rows only through [optim].total_steps,
# which the hash keeps). A resume or a twin that differs only in these is the same run.
_NOT_IN_ROWS = (
    "dir", "store", "weights", "ids", "id_time_ms", "checkpoint_every", "keep_checkpoints",
    "steps", "max_generated_tokens",
)  # fmt: skip


def seeded_id_prefix(cfg: TrainConfig) -> str:
    """The namespace of a seeded run's rollout ids: its seed and a hash of its config less the
    keys that change no row (its folders, checkpoint schedule, length: _NOT_IN_ROWS, and
    [eval]). Twin runs (same seed and config, any folders) write the same ids; runs that
    differ in a setting that shapes their rows (a replay source, a temperature, an explicit
    [run].run_id) do not collide when one imports the other's rows or they share a store."""
    import hashlib

    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in _NOT_IN_ROWS}
    d.pop("eval", None)  # evaluation settings change no generated row
    digest = hashlib.blake2b(json.dumps(d, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"seed{cfg.run.seed}-{digest}"


def id_scheme(meta: dict[str, Any]) -> tuple[str, int]:
    """(namespace prefix, UUIDv7 time field) of a run's rollout ids, from its run.json (runs
    started before [run].ids existed: their run id and start time, as they were made)."""
    ids = meta.get("ids")
    if isinstance(ids, dict):
        return str(ids["prefix"]), int(ids["time_ms"])
    return meta["run_id"], int(meta["start_ms"])


def check_twin_ids(store: RolloutStore, run_id: str, first_id: str) -> None:
    """At a fresh start: refuse when the store already holds this run's first rollout id from
    another run (a twin: the same seed and config, seeded ids, one shared store), whose rows
    this run would skip as its own instead of writing them."""
    rows = store.sql(
        "SELECT run_id FROM rollouts WHERE rollout_id = ? LIMIT 1", [first_id]
    ).to_pylist()
    if rows and rows[0]["run_id"] != run_id:
        raise RunDirError(
            f"the store already holds rollouts with this run's ids, written by run "
            f"{rows[0]['run_id']!r} (the same seed and config); set another [run].seed, an "
            '[run].run_id of its own, or [run].ids = "clock", or give this run its own store'
        )


def check_world_size(run_dir: Path, d: Dist) -> None:
    """Refuse to resume a run with a different number of learner ranks than wrote it."""
    found = saved_state(run_dir)  # the newest readable state.json (damaged ones skipped)
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


def prepare_model(cfg: TrainConfig, run_dir: Path) -> Path:
    """The initial model folder: built once for ``tiny``, else the configured path."""
    if cfg.model.path != "tiny":
        return check_model_dir(cfg.model.path)
    path = run_dir / "model-init"
    if not (path / "config.json").exists():
        from trainer.models.tiny import make_tiny_model

        tmp = run_dir / ".model-init-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # The dataset task trains the tiny tokenizer on its own questions; the others keep
        # the tokenizer they always had (arith's for file, whose runs assume its lengths).
        own = cfg.task.name == "dataset"
        make_tiny_model(
            tmp,
            task=cfg.task.name if own or cfg.task.name == "countdown" else "arith",
            task_kwargs=cfg.task.options if own else None,
            chat_template=cfg.task.chat_template is True,
            seed=cfg.model.seed,
            hidden_size=cfg.model.hidden_size,
            num_layers=cfg.model.num_layers,
            num_heads=cfg.model.hidden_size // 64,
            vocab_size=cfg.model.vocab_size,
        )
        tmp.rename(path)
    return path


def run_publisher(cfg: TrainConfig, run_dir: Path, device: torch.device, options=None) -> Publisher:
    """How the run publishes weights: in the generators' precision (``[generation].dtype``,
    default the model's), keeping ``[run] keep_weight_versions`` and the checkpoints' versions."""
    dtype = resolve_dtype(cfg.generation.dtype, device, key="[generation].dtype")
    return Publisher(run_dir, cfg.run.keep_weight_versions, dtype, options)
