"""Replay ratio x buffer size sweep in the paper's units (issue #19).

Arnal et al. (2026, https://arxiv.org/abs/2604.08706) claim that a FIFO replay buffer reaches
a given accuracy with up to ~40% less compute (generation + training) than on-policy RL, that
too much replay (y > ~10) hurts, that larger buffers are slower but stable, and that entropy is
preserved. This tool measures that on a task where generation is a real share of the cost.

**Task** (``tools/carry_task.py``, ``carry_add``): addition of two 2-3 digit numbers, answered
column by column (``"8+6=14 7+5+1=13 4+3+1=8 so 834"``, 20-35 tokens, ``max_tokens = 40``),
reward 1 iff the last integer is the sum. Model: the 2-layer tiny Qwen2 of
``examples/arith.toml`` (hidden 128), supervised warm start of ``--warm-steps`` steps on worked
answers, done once (``RUN_ROOT/warm``, seed ``--warm-seed``): every run of every cell starts from
the same weights, as runs from one pretrained checkpoint would; the seeds vary the RL only.

**Grid.** Every round generates ``R = 8 prompts x 8 = 64`` rollouts; every learner step draws a
batch of ``B = 64`` from the buffer. The replay ratio ``y = updates_per_round x B x ppo_epochs
/ R`` (learner passes per generated rollout) is set with ``updates_per_round``; the buffer
``N`` is the FIFO ``[replay] window`` in rounds' worth of rollouts (``n1`` = 64 rows: the
current round only, so ``y`` passes over it; ``n4``; ``n16``), no staleness or use cap.

* ``ppo-yY-nN`` for y in {1, 2, 4, 8, 16} x N in {1, 4, 16}: the clipped loss against the
  stored behaviour log-probs (eps 0.2 / 0.28, as the demo). ``ppo-y1-n1`` is **on-policy**
  (each rollout used exactly once, in the round it was generated; alias ``onpolicy``).
* at y = 8, N = 4: ``tis-y8-n4``, ``asymre-y8-n4``, ``m2po-y8-n4`` (``[loss] loss_type``,
  defaults of ``trainer.algo.loss_config``) and ``ppo-ep4-y8-n4``: PPO epochs, 2 drawn batches
  per round each trained ``ppo_epochs = 4`` times (the same y from repetition, not from the
  buffer).
* the paper's best buffer (issue #30; group ``paper``): positive-bias sampling with AsymRE
  (``asymre_delta = -0.1``) and with PPO, ``{asymre,ppo}-pos{25,50}-y{2,4}-n{4,16}``:
  ``positive_fraction`` = 25% or 50% of each batch from the freshest 25% / 50% x N correct
  rows of the window (``positive_pool``); and ``ppo-y4-n16-s8``, the 16x window capped at
  ``max_staleness = 8`` policy versions (2-3 rounds at y = 4). Names:
  ``tools/replay_sweep_grid.py``.

**Budget: equal compute.** Compute is counted in units of one learner pass over one rollout:
``compute = uses + mu x generated rollouts``, ``uses = steps x B x ppo_epochs``, ``mu`` =
generation cost / training cost per rollout. A run gets ``--budget-rounds K`` on-policy rounds'
worth of compute at ``mu = --mu-budget``, i.e. ``ceil(K (mu + 1) / (mu + y))`` rounds of
``y x R / B`` learner steps: high-y cells generate fewer tokens and take more learner steps.
The default budget mu is the paper's 5.3, not the ~1.1 measured here: at the measured mu a
y = 16 run would get 1/8.5 of on-policy's generation and could hardly reach any target, so
its compute to target would say nothing at mu = 5.3. With mu = 5.3 every cell gets the
generation it would get in the paper's regime, the runs are long enough to be re-weighted to
either mu, and "final" numbers compare runs of equal compute at mu = 5.3 (at the measured mu
the high-y runs spent more: the reward-vs-compute figure shows both). Each run evaluates
``--evals`` times (plus step 0) on ``--eval-prompts`` held-out prompts (one sample each,
temperature 1: the trainer's own eval).

**Measured per run** (``--cache``, one JSON entry per cell and seed): the eval curve (step,
generated tokens and rollouts, learner uses, reward), the loop's ``gen_seconds`` (sampling,
scoring, embedding, store appends) and ``train_seconds`` (drawing the batch and the learner
step), hence the run's ``mu = (gen_seconds / rollouts) / (train_seconds / uses)``; then the
final weights sample ``--passk-samples`` completions for each of ``--passk-prompts`` held-out
prompts (a fixed set, the same for every run): pass@1 and pass@4 (unbiased estimator), the
held-out entropy (mean negative log-prob of the sampled tokens, nats/token) and length.

**Report** (``--report``): per cell, mean and 95% bootstrap interval over seeds of generated
tokens and compute to the first eval whose 3-eval moving average is >= ``--target`` (at the
measured mu, the median over the cached runs, and at mu = 5.3, the paper's Qwen2.5-7B figure,
re-weighting the same runs), final pass@1 / pass@4 / held-out entropy; the best replay cell's
compute saving vs on-policy at equal accuracy, paired by seed, with its interval, at
``--target`` and at the targets 0.04 and 0.02 below and 0.02 above it (the target is a choice:
the sensitivity shows how much hangs on it); a figure with one panel per metric and one of
reward vs compute.

**Sizing** (from the pilot: on-policy and ``ppo-y4-n4``, seeds 0-2, ``--budget-rounds 60
--evals 10``, 2 runs in parallel while 3 other workers shared the 2 cores). The warm start
(250 steps at lr 1e-3, 70 s) gives held-out pass@1 0.30, pass@4 0.60, 27 tokens per
completion, entropy 0.21 nats/token. RL lr 1e-4 (2e-4 stalled, 3e-4 and above collapsed the
warm-started model within 5-10 steps): on-policy climbs to eval ~0.40 in 60 rounds (pass@1
0.42), and its smoothed curve crosses 0.38 after 18-42 rounds, hence ``--target 0.38``
(fixed before the sweep). Measured mu = 1.08 (1.02-1.17 over the runs): per rollout,
generating (HF sampling of ~27 tokens, scoring, hashing embedder, Lance append) costs about
what one learner pass (the replay draw + forward/backward) does on this CPU. Per run 100-270 s
wall, but the runs had only ~26% of a core each (CPU / wall seconds, recorded per run as
``cpu_s``). The defaults (90 on-policy rounds of compute at mu = 5.3, 12 evals of 256
prompts, pass@k on 128 prompts x 8) give 95 runs in phase 1 + 9 in phase 2: ``--plan`` says
~340 min at the pilot's loaded speed and ~90 min of CPU time on 2 cores, so ~100-130 min on an
otherwise idle machine. ``--plan`` prints the grid, the number of runs and the estimated wall
time from the cached runs (else from ``PILOT``). Phase 1 runs every cell with seeds 0-4;
phase 2 adds seeds 5-7 to on-policy and the two best replay cells (``best2``, chosen from the
cache)::

    python tools/replay_sweep.py --plan --jobs 2
    python tools/replay_sweep.py --jobs 2                                   # phase 1
    python tools/replay_sweep.py --jobs 2 --cells onpolicy best2 --seeds 5 6 7   # phase 2
    python tools/replay_sweep.py --report                                   # docs/results.md

**Tuned protocol** (issue #30; ``tools/replay_sweep_tune.py``): the first sweep used one lr
for every cell. ``--tune`` runs each ``--cells`` cell and on-policy at every ``--lr-grid`` lr
(cells ``NAME-lrX``) on ``--tune-seeds`` (a cell chosen at an end of the grid also runs one lr
beyond it: ``--lr-extend``); ``--evaluate`` runs each at the lr chosen on those seeds only on
``--fresh-seeds`` (>= 5, disjoint from the tuning seeds), on-policy first, then the cells best
first on the tuning seeds, each on all its fresh seeds before the next (so an evaluation cut
short already holds what the saving needs); ``--report`` adds the
compute-to-target vs lr tables and the best tuned replay cell's saving vs tuned on-policy on
the fresh seeds at both mu, with its sensitivity to the target::

    C="--cache docs/data/replay_sweep_paper.json"  # kept in the repository (see below)
    python tools/replay_sweep.py --tune --cells paper --plan --jobs 2 $C   # both phases, time
    python tools/replay_sweep.py --tune --cells paper --jobs 2 $C          # tuning phase
    python tools/replay_sweep.py --evaluate --cells paper --jobs 2 $C      # evaluation phase
    python tools/replay_sweep.py --report $C --out docs/results_tuned.md

The tuned sweep takes longer than one working session (~6-10 h on 2 cores), so its cache is a
tracked file, ``docs/data/replay_sweep_paper.json``, committed as runs finish: a fresh checkout
resumes where the last stopped. Every run starts from the warm start tracked in
``docs/data/replay_sweep_warm/`` (``--warm-from``; copied to ``RUN_ROOT/warm``). Rebuilt, it would
not be the same model on another CPU: the 250 supervised steps round differently under other
kernels (pass@1 0.298 on one machine, 0.267 on another). The cache holds its weights hash and
refuses runs from another start; each run records its machine (``machine``), and runs on two
machines from the one start are replicates, as two seeds are (with ``--start base`` the start
is the config's model folder, and the cache holds that folder's hash). ``--warm-from none``
builds a warm start here instead (in a new ``--run-root``, and then a new ``--cache``). The report
goes to ``docs/results_tuned.md``, beside the first sweep's in ``docs/results.md`` (whose cache
was not kept: a report written there from this cache would replace its tables).

**A real model** (issue #30 item 4): ``--start base`` runs the cells from the ``--config``'s own
model folder, task and eval settings (LoRA as it says; no warm start: ``RUN_ROOT/warm/warm.json``
holds the base model's held-out pass@k), e.g. on-policy vs one tuned cell on SmolLM2. The tiny
model's lrs do not carry over to a LoRA on SmolLM2 (its example trains at 5e-4), but their
ratio can: name each arm's lr, on-policy at 5e-4 and the cell at 5e-4 x (the cell's tuned lr /
on-policy's tuned lr), e.g. ``ppo-y1-n1-lr5e-4 asymre-pos50-y4-n16-lr2.5e-4``. The target,
0.30 greedy on held-out sums, is fixed before the runs (SmolLM2 starts at ~0.18 and on-policy
reached ~0.43 after 256 rollouts in docs/results.md); the cache is kept in the repository too,
and ``--report`` with the same options compares the two arms as cells (each named with its lr
in the report; no tuned section). Sizing: rounds of 16 prompts x 8 (128 rollouts, as
``make demo-smollm2``), 4 on-policy rounds of compute at mu = 5.3 (512 rollouts, 16 learner
steps), greedy evals on 128 held-out prompts each round. A first size, 8 prompts x 8, was too
small: at temperature 1 the base model samples ~2-10% correct answers, so a round of 64 gave
the learner a few correct rollouts, and on-policy learned on one seed of three (greedy eval
0.16 -> 0.53; 0.27 -> 0.23 and 0.22 -> 0.23 on the others). On 2 cores with vLLM generating, an
on-policy run took 15-17 min; a y = 2 run takes twice its learner steps (~1 s per row, the
larger share of a run)::

    S="--config examples/smollm2_arith.toml --start base --run-root runs/sweep_smollm2
       --cache docs/data/replay_sweep_smollm2.json --seeds 0 1 2 --target 0.30
       --prompts-per-round 16 --group-size 8 --batch-size 32 --budget-rounds 4 --evals 4
       --eval-prompts 128 --passk-prompts 32 --passk-samples 4 --lr 5e-4"
    python tools/replay_sweep.py $S --cells ppo-y1-n1-lr5e-4 CELL-lrX --jobs 1 --threads 2
    python tools/replay_sweep.py $S --cells ppo-y1-n1-lr5e-4 CELL-lrX --report \
        --out docs/results_smollm2_replay.md

Resumable: finished (cell, seed) runs are cached as they end and skipped when their config
is unchanged; an interrupted run is started again from scratch. Run folders are pruned to
``metrics.jsonl`` + ``run.json`` unless ``--keep-runs``. The tiny model's cells generate with
transformers (``hf``): vLLM's engine start per run and its threads do not fit 2 runs on 2 cores.
``--start base`` keeps the config's backend (vLLM for SmolLM2, one run at a time).

Code: this file is the command and the running of cells (the warm start, a run, its held-out
pass@k, the worker pool); the grid, the run configs, the cache and ``--plan``'s estimate are in
``tools/replay_sweep_grid.py``; the analysis and ``docs/results.md`` in
``tools/replay_sweep_report.py``; the lr choice and the tuned section in
``tools/replay_sweep_tune.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rolloutstore.errors import Terminated  # noqa: E402
from rolloutstore.query.limits import sigint_interrupts  # noqa: E402
from tools.replay_common import copy_sections, load_base, read_metrics  # noqa: E402
from tools.replay_sweep_grid import (  # noqa: E402
    GRID,
    GROUPS,
    ONPOLICY,
    PAPER_CELLS,
    PASSK_SEED,
    TASK,
    WARM_KEPT,
    Cache,
    Cell,
    Sizing,
    build_config,
    config_hash,
    cost_model,
    estimate_seconds,
    lr_name,
    machine,
    parse_cell,
    plan,
    schedule,
    start_from_base,
    warm_dir,
    weights_digest,
)
from tools.replay_sweep_report import (  # noqa: E402
    best_cells,
    measured_mu,
    named_arms,
    report,
    summarise_cells,
)
from tools.replay_sweep_tune import (  # noqa: E402
    DEFAULT_LR_GRID,
    FRESH_SEEDS,
    MIN_FRESH,
    TUNE_SEEDS,
    LrChoice,
    check_seeds,
    choose_lr,
    evaluation_order,
    extended_grid,
    to_run,
    tuned_section,
)
from trainer.rollout.evaluation import pass_at_k  # noqa: E402  (the runs' [eval] reports it)


# -- running ------------------------------------------------------------------------------------
def ensure_warm(
    base: dict[str, Any], sz: Sizing, run_root: Path, kept: Path | None = WARM_KEPT
) -> dict[str, Any]:
    """The warm-started model every run starts from (the RL seeds vary, the start does not, as
    runs from one pretrained checkpoint), in ``RUN_ROOT/warm`` with its held-out pass@k and
    weights hash: copied from ``kept`` (the tracked one) when its spec is this sizing's, else
    built here once."""
    import torch

    from trainer.config import TrainConfig
    from trainer.models.load import load_model
    from trainer.run.setup import prepare_model, warm_start

    out, seed = warm_dir(run_root), sz.warm_seed
    from_base = start_from_base(sz)  # no warm start: the base model's own held-out pass@k
    if from_base:
        spec = {"start": "base", "model": base.get("model"), "task": base.get("task")}
    else:
        spec = {"steps": sz.warm_steps, "lr": sz.warm_lr, "seed": seed, "model": base.get("model")}
    info_path = out / "warm.json"
    if not from_base and kept is not None and (kept / "warm.json").exists():
        info = json.loads((kept / "warm.json").read_text())
        if info.get("spec") == spec:
            return _take_warm(kept, out, info)
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("spec") == spec and "weights" in info:
            return info
    if from_base:
        # The start is the base folder's weights (each run's LoRA init comes from its seed):
        # their hash lets a cache resume on another machine, whose held-out figures of the
        # same start differ in the last digits.
        cfg = build_config(base, ONPOLICY, seed, sz, run_root)
        return _record_warm(info_path, spec, Path(cfg.model.path), 0.0, cfg, sz)
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    d = copy_sections(base)
    for section, values in TASK.items():
        d.setdefault(section, {}).update(copy_sections(values))
    d["model"]["path"] = "tiny"
    d["run"].update(dir=str(tmp), seed=seed)
    cfg = TrainConfig.from_dict(d)
    init = prepare_model(cfg, tmp)  # tmp/model-init, the tiny model with arith's tokenizer
    model, tok = load_model(init, dtype=torch.float32)
    task = cfg.task.build()
    warm_start(model, tok, task, steps=sz.warm_steps, lr=sz.warm_lr, seed=seed)
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    shutil.rmtree(out, ignore_errors=True)
    (tmp / "model").rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return _record_warm(info_path, spec, out, time.perf_counter() - t0, cfg, sz)


def _record_warm(
    info_path: Path, spec: dict[str, Any], folder: Path, seconds: float, cfg: Any, sz: Sizing
) -> dict[str, Any]:
    """The start's ``warm.json``: its spec, build time, the weights hash of ``folder`` (its
    identity in a cache) and held-out figures, with the machine that scored them."""
    info = {"spec": spec, "seconds": seconds, "weights": weights_digest(folder)}
    info.update(heldout(folder, cfg, sz), machine=machine())
    info_path.parent.mkdir(parents=True, exist_ok=True)
    info_path.write_text(json.dumps(info, indent=1))
    return info


def _take_warm(kept: Path, out: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The tracked warm start ``kept``, copied to ``out`` (unless already there): its weights
    must be those its ``warm.json`` names. Its held-out figures are those measured where it was
    built (``info["machine"]``)."""
    if (have := weights_digest(kept)) != info.get("weights"):
        raise SystemExit(
            f"{kept}: its weights (hash {have}) are not the ones its warm.json "
            f"names ({info.get('weights')}); restore the folder from git, or build one here "
            "with --warm-from none"
        )
    try:
        if weights_digest(out) == info["weights"] and (out / "warm.json").exists():
            return info  # copied before
    except FileNotFoundError:
        pass
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(kept, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


def heldout(model_dir: Path, cfg: Any, sz: Sizing) -> dict[str, float]:
    """pass@1, pass@4, entropy and length of the model in ``model_dir`` on the fixed held-out
    prompts (``passk_samples`` samples each at the training temperature)."""
    from trainer.rollout.hf import HFGenerator
    from trainer.rollout.weights import is_adapter_folder, model_folder, read_published
    from trainer.tasks.chat import render_prompts

    task = cfg.task.build()
    gen = HFGenerator(model_folder(model_dir), dtype=cfg.generation.dtype)
    if is_adapter_folder(model_dir):  # a LoRA run's version: its adapters, merged
        gen.model.load_state_dict(read_published(model_dir))
    prompts = render_prompts(
        gen.tokenizer, task.make_eval_prompts(sz.passk_prompts, seed=PASSK_SEED),
        task.chat_template,
    )  # fmt: skip
    g, n = cfg.generation, sz.passk_samples
    rows = gen.generate(
        [p.prompt_text for p in prompts], **g.sampling(group_size=n, seed=PASSK_SEED).kwargs()
    )
    correct = [0] * len(prompts)
    nll = tokens = 0.0
    for k, row in enumerate(rows):
        p = prompts[k // n]
        correct[k // n] += task.reward(p, row["completion_text"]).info.get("correct", False)
        nll -= sum(row["behavior_logprobs"])
        tokens += len(row["completion_ids"])
    return {
        "pass1": float(np.mean([pass_at_k(n, c, 1) for c in correct])),
        "pass4": float(np.mean([pass_at_k(n, c, 4) for c in correct])) if n >= 4 else math.nan,
        "heldout_entropy": nll / max(tokens, 1),
        "heldout_tokens": tokens / max(len(rows), 1),
    }


def summarise_run(recs: list[dict[str, Any]], cell: Cell, batch_size: int) -> dict[str, Any]:
    """A run's metrics as the cache keeps them (no target, no mu: those are the report's)."""
    evals = [r for r in recs if r["kind"] == "eval"]
    train = [r for r in recs if r["kind"] == "train"]
    if not train or not evals:
        raise ValueError("a run without train or eval records")
    per_use = batch_size * cell.epochs
    curve = [
        [
            r["step"],
            r.get("generated_tokens", 0),
            r.get("generated_rollouts", 0),
            r["step"] * per_use,
            r["reward"],
        ]
        for r in evals
    ]
    last = train[-1]
    uses = last["step"] * per_use
    gen_s, train_s = last["gen_seconds"], last["train_seconds"]
    tail = [r["entropy"] for r in train[-max(5, cell.y) :] if r.get("entropy") is not None]
    return {
        "curve": curve,
        "steps": last["step"],
        "tokens": last["generated_tokens"],
        "rollouts": last["generated_rollouts"],
        "uses": uses,
        "gen_seconds": gen_s,
        "train_seconds": train_s,
        "mu": (gen_s / last["generated_rollouts"]) / (train_s / uses) if train_s > 0 else math.nan,
        "first_reward": evals[0]["reward"],
        "final_reward": evals[-1]["reward"],
        "train_entropy": float(np.mean(tail)) if tail else math.nan,
        **drift_proxies(train),
    }


def drift_proxies(train: list[dict[str, Any]]) -> dict[str, float]:
    """What issue #30's theory check measures per run, over every drawn row of every step:
    the staleness (policy versions between a row's generation and its use) mean and variance,
    and the mean approx. KL between the learner and the behaviour policy on the drawn rows
    (staleness drift plus the learner having trained on those very rows: the sample-iterate
    coupling of reuse) and the effective-sample-size fraction of the importance weights."""
    counts: dict[int, int] = {}
    for r in train:
        for k, v in (r.get("staleness_hist") or {}).items():
            counts[int(k)] = counts.get(int(k), 0) + int(v)
    n = sum(counts.values())
    mean = sum(k * v for k, v in counts.items()) / n if n else math.nan
    var = sum((k - mean) ** 2 * v for k, v in counts.items()) / n if n else math.nan

    def avg(key: str) -> float:
        vals = [r[key] for r in train if r.get(key) is not None]
        return float(np.mean(vals)) if vals else math.nan

    return {
        "staleness_mean": mean,
        "staleness_var": var,
        "approx_kl_mean": avg("approx_kl"),
        "ess_frac_mean": avg("ess_frac"),
    }


def run_cell(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (cell, seed) from scratch, then score its final weights; the cache record."""
    from trainer.config import TrainConfig
    from trainer.rollout.weights import latest_weights
    from trainer.run.sync import train

    cfg = TrainConfig.from_dict(job["config"])
    cell, sz = parse_cell(job["cell"]), Sizing(**job["sizing"])
    run_dir = Path(cfg.run.dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    train(cfg, progress=False)
    train_wall = time.perf_counter() - t0
    rec = summarise_run(read_metrics(run_dir), cell, sz.batch_size)
    _, weights = latest_weights(run_dir / "weights")
    rec.update(heldout(Path(weights), cfg, sz))
    rec.update(
        cell=cell.name,
        seed=cfg.run.seed,
        hash=job["hash"],
        train_wall_s=train_wall,
        wall_s=time.perf_counter() - t0,
        cpu_s=time.process_time() - cpu0,  # all threads; ~ wall_s when the run had a core
        finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
        machine=machine(),
    )
    if not job.get("keep"):
        for p in run_dir.iterdir():
            if p.name not in ("metrics.jsonl", "run.json"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    return rec


def make_jobs(
    base: dict[str, Any],
    cells: list[Cell],
    seeds: list[int],
    sz: Sizing,
    run_root: Path,
    cache: Cache,
    keep: bool = False,
    cell_major: bool = False,
) -> list[dict[str, Any]]:
    """The (cell, seed) runs not in the cache with the current configuration, seed-major (an
    interrupted sweep then holds whole seeds of most cells), or with ``cell_major`` every seed
    of a cell before the next (``--evaluate``: its cells come best first)."""
    jobs = []
    if cell_major:
        order = [(c, s) for c in cells for s in seeds]
    else:
        order = [(c, s) for s in seeds for c in cells]
    for cell, seed in order:
        cfg = build_config(base, cell, seed, sz, run_root)
        digest = config_hash(cfg, sz)
        if cache.done(cell, seed, digest):
            continue
        jobs.append(
            {
                "config": cfg.to_dict(),
                "cell": cell.name,
                "seed": seed,
                "sizing": dataclasses.asdict(sz),
                "hash": digest,
                "keep": keep,
            }
        )
    return jobs


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_jobs(
    jobs: list[dict[str, Any]],
    cache: Cache,
    *,
    base: dict[str, Any],
    sz: Sizing,
    run_root: Path,
    workers: int,
    threads: int,
    kept: Path | None = WARM_KEPT,
) -> int:
    """The warm start (once; ``kept``: see ``ensure_warm``), then every job; each result cached
    as it ends. Returns the number of failed runs."""
    _init_worker(threads)
    cache.adopt_warm(ensure_warm(base, sz, run_root, kept))
    cache.save()
    failed = 0
    if workers <= 1:
        for j in jobs:
            failed += _finish(cache, j, lambda j=j: run_cell(j))
        return failed
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    ctx = mp.get_context("spawn")
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(threads,))
    try:
        futures = {ex.submit(run_cell, j): j for j in jobs}
        for fut in as_completed(futures):
            failed += _finish(cache, futures[fut], fut.result)
    except BaseException:
        # ^C or SIGTERM: the runs in flight are stopped, not waited for (minutes each), and no
        # worker is left running on its own; the finished runs are in the cache already.
        ex.shutdown(wait=False, cancel_futures=True)
        for proc in mp.active_children():
            proc.terminate()
        raise
    ex.shutdown()
    return failed


def _finish(cache: Cache, job: dict[str, Any], get) -> int:
    try:
        rec = get()
    except Exception as exc:  # one failed run must not stop the sweep: report, go on
        print(f"FAILED {job['cell']}/s{job['seed']}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    cache.put(parse_cell(rec["cell"]), rec["seed"], rec)
    print(
        f"{rec['cell']}/s{rec['seed']}: eval {rec['first_reward']:.3f} -> {rec['final_reward']:.3f}"
        f", pass@1 {rec['pass1']:.3f}, {rec['tokens']:,} tokens, {rec['steps']} steps, "
        f"mu {rec['mu']:.2f}, {rec['wall_s']:.0f} s",
        flush=True,
    )
    return 0


# -- main ---------------------------------------------------------------------------------------
def select_cells(tokens: list[str], cache: Cache, hashes_for, target: float) -> list[Cell]:
    """Cell names, globs (``ppo-y*-n4``), groups (``all``: the first sweep's grid; ``paper``: the
    paper's best buffer), ``onpolicy``, ``best`` / ``bestK`` (the K best replay cells by
    compute to target at the measured mu, from the cache)."""
    out: list[Cell] = []
    names = {c.name: c for c in GRID + PAPER_CELLS}
    for tok in tokens:
        if tok in GROUPS:
            got = list(GROUPS[tok])
        elif m := re.fullmatch(r"best(\d*)", tok):
            records = cache.records(hashes_for(GRID))
            summ = summarise_cells(records, target, measured_mu(records), n_boot=200)
            got = best_cells(summ, "compute_to_target@measured", int(m[1] or 1))
            if not got:
                raise SystemExit(f"{tok}: no cached replay cell reached {target} on every seed")
            print(f"{tok}: {', '.join(c.name for c in got)}")
        elif any(ch in tok for ch in "*?["):
            got = [names[n] for n in fnmatch.filter(names, tok)]
            if not got:
                raise SystemExit(f"{tok}: matches no cell of the grid or the paper group")
        else:
            got = [parse_cell(tok)]
        out += [c for c in got if c not in out]
    return out


def parser() -> argparse.ArgumentParser:
    """The sweep's options: its own, then one per field of ``Sizing`` (``--budget-rounds`` ...)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arith.toml", help="base")
    ap.add_argument("--cells", nargs="+", default=["all"], help="names, globs, all, paper, best2")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    phase = ap.add_mutually_exclusive_group()
    phase.add_argument(
        "--tune", action="store_true",
        help="tuning phase: --cells and on-policy at each --lr-grid lr on --tune-seeds",
    )  # fmt: skip
    phase.add_argument(
        "--evaluate", action="store_true",
        help="evaluation phase: --cells and on-policy at their tuned lr on --fresh-seeds",
    )  # fmt: skip
    ap.add_argument("--lr-grid", type=float, nargs="+", default=list(DEFAULT_LR_GRID))
    ap.add_argument(
        "--lr-extend", type=int, default=1,
        help="widen a cell's lr grid this many times (half the lowest, twice the highest lr) "
        "while its choice is at an end of it (--tune runs the new lrs; 0: never)",
    )  # fmt: skip
    ap.add_argument("--tune-seeds", type=int, nargs="+", default=list(TUNE_SEEDS))
    ap.add_argument(
        "--fresh-seeds", type=int, nargs="+", default=list(FRESH_SEEDS),
        help=f"the evaluation phase's seeds (>= {MIN_FRESH}, none a tuning seed)",
    )  # fmt: skip
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs/sweep")
    ap.add_argument("--cache", type=Path, default=None, help="default RUN_ROOT/cache.json")
    ap.add_argument(
        "--warm-from", type=lambda v: None if v in ("", "none") else Path(v), default=WARM_KEPT,
        help="the tracked warm start, used when its spec is the sizing's (none: not it; the one "
        "in RUN_ROOT/warm if it has this spec, else one built here)",
    )  # fmt: skip
    ap.add_argument("--keep-runs", action="store_true", help="keep stores, weights, checkpoints")
    ap.add_argument("--plan", action="store_true", help="print the grid and estimate; run none")
    ap.add_argument("--report", action="store_true", help="write --out from the cache")
    ap.add_argument("--pilot", action="store_true", help="--report: mark it a pilot")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results.md")
    ap.add_argument("--target", type=float, default=0.38, help="held-out reward to reach")
    ap.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    for f in dataclasses.fields(Sizing):
        ap.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
            help=f"sizing (default {f.default})",
        )  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)  # as the cache and report quote it
    sz = Sizing(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizing)})
    cache = Cache(args.cache or args.run_root / "cache.json")
    base = load_base(args.config)

    def hashes_for(cells: list[Cell], seeds: list[int] | None = None) -> dict[str, str]:
        seeds = seeds if seeds is not None else sorted({r["seed"] for r in cache.runs.values()})
        return {
            Cache.key(c, s): config_hash(build_config(base, c, s, sz, args.run_root), sz)
            for c in cells
            for s in seeds
        }

    if args.tune or args.evaluate or args.report:
        try:
            check_seeds(args.tune_seeds, args.fresh_seeds, 1 if args.pilot else MIN_FRESH)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    cells = select_cells(args.cells, cache, hashes_for, args.target)
    if args.report:
        return _report(args, argv, sz, cache, hashes_for)
    seeds = args.seeds
    if args.tune or args.evaluate:
        # On-policy is tuned and evaluated as every cell is: it is the baseline.
        bases = list(dict.fromkeys([ONPOLICY] + [c.base for c in cells]))
        if args.tune:
            cells = [c.at(lr) for c in bases for lr in args.lr_grid]
            seeds = args.tune_seeds
        else:
            choices = tuned_choices(args, sz, cache, hashes_for, bases)
            cells = evaluation_order(choices, sz.mu_budget)
            seeds = args.fresh_seeds
            if not cells:
                raise SystemExit("no cell has a tuned lr yet: run --tune first (same --cells)")
    if args.plan:
        print(plan(cells, seeds, sz, cache, hashes_for(cells, seeds), args.jobs))
        if args.tune:
            if args.lr_extend:
                print(
                    f"plus, for each cell whose lr falls at an end of the grid, up to "
                    f"{args.lr_extend} more lr(s) beyond it x {len(seeds)} tuning seeds "
                    "(--lr-extend)"
                )
            print(_plan_evaluation(bases, args, sz, cache))
        return 0
    rc = _run(args, argv, sz, cache, base, cells, seeds)
    done: list[Cell] = []
    while args.tune and args.lr_extend and rc == 0:
        # Widen the grids whose choice fell at an end; until no cell needs another run.
        records, choices = _tuning(args, sz, cache, hashes_for, bases)
        more = to_run(choices, args.tune_seeds, records)
        if not more or more == done:  # nothing new (or runs that do not land in the cache)
            break
        print(f"widening the lr grid: {', '.join(c.name for c in more)}")
        rc, done = _run(args, argv, sz, cache, base, more, args.tune_seeds), more
    return rc


def _tuning(
    args: argparse.Namespace, sz: Sizing, cache: Cache, hashes_for, bases: list[Cell]
) -> tuple[dict[Cell, dict[int, dict]], dict[Cell, LrChoice]]:
    """The cached tuning-seed runs of ``bases`` (at every lr the grid and its widenings may
    hold) and each cell's lr choice from them."""
    lrs = extended_grid(args.lr_grid, args.lr_extend)
    tuning = [c.at(lr) for c in bases for lr in lrs]
    records = cache.records(hashes_for(tuning, args.tune_seeds))
    choices = {
        c: choose_lr(
            records, c, args.lr_grid, args.tune_seeds, args.target, sz.mu_budget, args.lr_extend
        )
        for c in bases
    }
    return records, choices


def tuned_choices(
    args: argparse.Namespace, sz: Sizing, cache: Cache, hashes_for, bases: list[Cell]
) -> list[LrChoice]:
    """Each cell's lr, chosen on its cached tuning-seed runs only (printed, one line each)."""
    out = []
    for c, ch in _tuning(args, sz, cache, hashes_for, bases)[1].items():
        if ch.lr is None:
            print(f"{c.name}: not tuned (missing {'; '.join(ch.missing)}): left out")
        else:
            p = ch.chosen
            print(f"{c.name}: lr {lr_name(ch.lr)} ({p.reached}/{len(p.hits)} tuning seeds reached)")
        out.append(ch)
    return out


def _plan_evaluation(bases: list[Cell], args: argparse.Namespace, sz: Sizing, cache: Cache) -> str:
    """``--plan --tune``'s last line: what the evaluation phase will add."""
    cm = cost_model(cache)
    runs = [estimate_seconds(c, sz, cm) for c in bases for _ in args.fresh_seeds]
    wall = schedule(runs, args.jobs)
    return (
        f"then the evaluation phase (--evaluate): {len(runs)} runs ({len(bases)} cells x "
        f"{len(args.fresh_seeds)} fresh seeds), about {wall / 60:.0f} min with --jobs {args.jobs}"
    )


def _report(args: argparse.Namespace, argv: list[str], sz: Sizing, cache: Cache, hashes_for) -> int:
    """``--report``: the report of every cached run whose configuration is the current one."""
    cached_cells = sorted({parse_cell(r["cell"]) for r in cache.runs.values()})
    hashes = hashes_for(cached_cells)
    stale = sum(1 for k, r in cache.runs.items() if hashes.get(k) != r.get("hash"))
    if stale:
        print(f"note: {stale} cached runs have another configuration; left out")
    cmd = " ".join(["python tools/replay_sweep.py"] + [shlex.quote(a) for a in argv])
    records = cache.records(hashes)
    protocol = set(args.tune_seeds) | set(args.fresh_seeds)
    arms = named_arms(records, protocol)
    # The tuned protocol's runs: at a tuned lr, on its seeds.
    records = {
        c: {s: r for s, r in rr.items() if s in protocol} for c, rr in records.items() if c.lr
    }
    records = {c: rr for c, rr in records.items() if rr}
    tuned = []
    if records:
        tuned = tuned_section(
            records, lr_grid=args.lr_grid, tune_seeds=args.tune_seeds,
            fresh_seeds=args.fresh_seeds, target=args.target, choice_mu=sz.mu_budget,
            n_boot=args.bootstrap, figure=args.out.with_name(f"{args.out.stem}_lr.png"),
            extend=args.lr_extend,
        )  # fmt: skip
    block = report(
        cache, hashes, sz, target=args.target, out=args.out, command=cmd,
        n_boot=args.bootstrap, pilot=args.pilot, tuned=tuned, arms=arms,
    )  # fmt: skip
    print(block)
    return 0


def _run(
    args: argparse.Namespace,
    argv: list[str],
    sz: Sizing,
    cache: Cache,
    base: dict[str, Any],
    cells: list[Cell],
    seeds: list[int],
) -> int:
    """The sweep: every (cell, seed) run not cached yet. Exit status 1 if any failed."""
    jobs = make_jobs(
        base, cells, seeds, sz, args.run_root, cache, keep=args.keep_runs,
        cell_major=args.evaluate,
    )  # fmt: skip
    print(f"{len(jobs)} runs to do ({len(cells) * len(seeds) - len(jobs)} cached)")
    if not jobs:
        return 0
    t0 = time.perf_counter()
    cache.begin_session(argv, args.jobs)
    try:
        with sigint_interrupts():  # SIGTERM (kill, a scheduler) stops the sweep as ^C does
            failed = run_jobs(
                jobs, cache, base=base, sz=sz, run_root=args.run_root, workers=args.jobs,
                threads=args.threads, kept=args.warm_from,
            )  # fmt: skip
    finally:
        # Count the session's time even when a run (or ^C) stopped the sweep.
        cache.tick()
        cache.save()
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt as exc:  # the finished runs are cached; a rerun skips them
        print(f"stopped ({'SIGTERM' if isinstance(exc, Terminated) else '^C'})", file=sys.stderr)
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None
