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

Resumable: finished (cell, seed) runs are cached as they end and skipped when their config
is unchanged; an interrupted run is started again from scratch. Run folders are pruned to
``metrics.jsonl`` + ``run.json`` unless ``--keep-runs``. Generation uses transformers (``hf``):
vLLM's engine start per run and its threads do not fit 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import carry_task  # noqa: E402  (registers the task)
from tools.replay_common import copy_sections, load_base, read_metrics  # noqa: E402
from tools.replay_common import write_report as _write_report  # noqa: E402

PAPER = "https://arxiv.org/abs/2604.08706"
PAPER_MU = 5.3  # the paper's generation / training cost per rollout for Qwen2.5-7B
SCHEMA = 1  # bump when what a cached record means changes
PASSK_SEED = 424_242  # the held-out pass@k prompt set and its sampling seed: one for all runs
LOSSES = ("ppo", "tis", "asymre", "m2po")
SWEEP_BEGIN, SWEEP_END = "<!-- sweep:begin -->", "<!-- sweep:end -->"

# The task and model every cell shares, over the base config (examples/arith.toml).
TASK = {
    "task": {"name": carry_task.NAME, "options": {"min_digits": 2, "max_digits": 3}},
    "generation": {"backend": "hf", "max_tokens": 40},
}

# Pilot (see the module docstring): per-rollout and per-step costs that --plan uses until the
# cache holds runs of its own. Measured with 2 runs in parallel, 1 torch thread each.
PILOT = {
    "gen_s_per_rollout": 0.0168,  # sampling + scoring + embedding + store append
    "train_s_per_pass": 0.99,  # one learner pass over a batch of 64 (the draw + the step)
    "overhead_s": 62.0,  # start, model load, evals, checkpoint, pass@k sampling
    "warm_s": 69.0,  # the warm start (once)
    "mu": 1.08,
    "cpu_share": 0.26,  # CPU seconds / wall seconds of a run: the cores were shared
    "loaded": True,
}


# -- the grid -----------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Cell:
    loss: str
    y: int  # learner passes per generated rollout
    n: int  # FIFO window in rounds' worth of rollouts
    epochs: int = 1  # [optim] ppo_epochs

    @property
    def name(self) -> str:
        ep = f"-ep{self.epochs}" if self.epochs > 1 else ""
        return f"{self.loss}{ep}-y{self.y}-n{self.n}"

    @property
    def onpolicy(self) -> bool:
        return (self.loss, self.y, self.n, self.epochs) == ("ppo", 1, 1, 1)

    def label(self) -> str:
        return f"{self.name} (on-policy)" if self.onpolicy else self.name


CELL_RE = re.compile(r"^(?P<loss>[a-z0-9]+)(?:-ep(?P<ep>\d+))?-y(?P<y>\d+)-n(?P<n>\d+)$")


def parse_cell(name: str) -> Cell:
    if name == "onpolicy":
        return ONPOLICY
    m = CELL_RE.match(name)
    if not m or m["loss"] not in LOSSES:
        raise ValueError(f"not a cell name: {name!r} (e.g. ppo-y4-n4, ppo-ep4-y8-n4, onpolicy)")
    return Cell(m["loss"], int(m["y"]), int(m["n"]), int(m["ep"] or 1))


ONPOLICY = Cell("ppo", 1, 1)
GRID = [Cell("ppo", y, n) for y in (1, 2, 4, 8, 16) for n in (1, 4, 16)] + [
    Cell("tis", 8, 4),
    Cell("asymre", 8, 4),
    Cell("m2po", 8, 4),
    Cell("ppo", 8, 4, epochs=4),
]


@dataclass(frozen=True)
class Sizing:
    """Everything but the cell and the seed that a run's result depends on."""

    prompts_per_round: int = 8
    group_size: int = 8
    batch_size: int = 64
    budget_rounds: int = 90  # compute of this many on-policy rounds, at mu_budget
    mu_budget: float = PAPER_MU
    evals: int = 12
    eval_prompts: int = 256
    passk_prompts: int = 128
    passk_samples: int = 8
    warm_steps: int = 250
    warm_lr: float = 1e-3
    warm_seed: int = 0
    lr: float = 1e-4

    @property
    def rollouts_per_round(self) -> int:
        return self.prompts_per_round * self.group_size

    def updates_per_round(self, cell: Cell) -> int:
        num = cell.y * self.rollouts_per_round
        den = self.batch_size * cell.epochs
        if num % den:
            raise ValueError(f"{cell.name}: y x R = {num} is not a multiple of B x epochs = {den}")
        return num // den

    def rounds(self, cell: Cell) -> int:
        mu = self.mu_budget
        return max(1, math.ceil(self.budget_rounds * (mu + 1) / (mu + cell.y) - 1e-9))

    def eval_every_rounds(self, cell: Cell) -> int:
        return max(1, round(self.rounds(cell) / self.evals))


def build_config(base: dict[str, Any], cell: Cell, seed: int, sz: Sizing, run_root: Path) -> Any:
    """The validated ``TrainConfig`` of ``cell`` for ``seed``."""
    from trainer.config import TrainConfig

    d = copy_sections(base)
    for section, values in TASK.items():
        d.setdefault(section, {}).update(copy_sections(values))
    upr = sz.updates_per_round(cell)
    steps = sz.rounds(cell) * upr
    R = sz.rollouts_per_round
    d["model"]["path"] = str(warm_dir(run_root))
    d["task"]["eval_prompts"] = sz.eval_prompts
    d["generation"].update(prompts_per_round=sz.prompts_per_round, group_size=sz.group_size)
    d["run"].update(
        dir=str(run_root / cell.name / f"s{seed}"),
        seed=seed,
        steps=steps,
        updates_per_round=upr,
        batch_size=sz.batch_size,
        warm_start_steps=0,  # done once for all runs: warm_dir()
        eval_every=sz.eval_every_rounds(cell) * upr,
        checkpoint_every=steps,
        keep_checkpoints=1,
        max_generated_tokens=0,
    )
    # The FIFO buffer alone: no staleness or use cap (the window bounds both).
    d["replay"] = {"window": cell.n * R, "seed": seed, "priority": "uniform", "diversity": "none"}
    d["loss"]["loss_type"] = cell.loss
    d.setdefault("optim", {}).update(lr=sz.lr, ppo_epochs=cell.epochs, mini_batches=1, seed=seed)
    return TrainConfig.from_dict(d)


def config_hash(cfg: Any, sz: Sizing) -> str:
    """What a cached result depends on: the config (less its folders), warm start and pass@k."""
    d = cfg.to_dict()
    d["run"]["dir"] = d["model"]["path"] = ""
    extra = {
        "warm": [sz.warm_steps, sz.warm_lr, sz.warm_seed],
        "passk": [sz.passk_prompts, sz.passk_samples, PASSK_SEED],
        "schema": SCHEMA,
    }
    blob = json.dumps({"config": d, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_dir(run_root: Path) -> Path:
    return run_root / "warm"


# -- the cache ----------------------------------------------------------------------------------
class Cache:
    """``{"runs": {"CELL/sSEED": record}, "warm": {...}, "sessions": [...]}`` in one JSON file,
    rewritten atomically after every finished run (``warm``: the warm start's spec, seconds
    and held-out pass@k)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.runs: dict[str, dict] = data.get("runs", {})
        self.warm: dict[str, Any] = data.get("warm", {})
        self.sessions: list[dict] = data.get("sessions", [])

    @staticmethod
    def key(cell: Cell, seed: int) -> str:
        return f"{cell.name}/s{seed}"

    def done(self, cell: Cell, seed: int, digest: str) -> bool:
        rec = self.runs.get(self.key(cell, seed))
        return rec is not None and rec.get("hash") == digest

    def begin_session(self, argv: list[str], jobs: int) -> None:
        """Count this invocation's wall time (updated as runs finish, so a killed sweep's
        time up to its last finished run is kept)."""
        self._t0 = time.perf_counter()
        self.sessions.append({"argv": argv, "jobs": jobs, "seconds": 0.0, "runs": 0})
        self.save()

    def tick(self, ran: int = 0) -> None:
        if getattr(self, "_t0", None) is not None:
            self.sessions[-1]["seconds"] = time.perf_counter() - self._t0
            self.sessions[-1]["runs"] += ran

    def put(self, cell: Cell, seed: int, record: dict) -> None:
        self.runs[self.key(cell, seed)] = record
        self.tick(1)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        data = {"schema": SCHEMA, "runs": self.runs, "warm": self.warm, "sessions": self.sessions}
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def records(self, hashes: dict[str, str] | None = None) -> dict[Cell, dict[int, dict]]:
        """Cached records by cell and seed (only those whose hash matches, when given)."""
        out: dict[Cell, dict[int, dict]] = {}
        for key, rec in self.runs.items():
            if hashes is not None and hashes.get(key) != rec.get("hash"):
                continue
            out.setdefault(parse_cell(rec["cell"]), {})[rec["seed"]] = rec
        return out


# -- running ------------------------------------------------------------------------------------
def ensure_warm(base: dict[str, Any], sz: Sizing, run_root: Path) -> dict[str, Any]:
    """The warm-started model every run starts from (built once; the RL seeds vary, the start
    does not, as runs from one pretrained checkpoint), with its held-out pass@k."""
    import torch

    from trainer.config import TrainConfig
    from trainer.models.load import load_model
    from trainer.run.setup import prepare_model, warm_start

    out, seed = warm_dir(run_root), sz.warm_seed
    spec = {"steps": sz.warm_steps, "lr": sz.warm_lr, "seed": seed, "model": base.get("model")}
    info_path = out / "warm.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("spec") == spec:
            return info
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
    info = {"spec": spec, "seconds": time.perf_counter() - t0}
    info.update(heldout(out, cfg, sz))
    info_path.write_text(json.dumps(info, indent=1))
    return info


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def heldout(model_dir: Path, cfg: Any, sz: Sizing) -> dict[str, float]:
    """pass@1, pass@4, entropy and length of the model in ``model_dir`` on the fixed held-out
    prompts (``passk_samples`` samples each at the training temperature)."""
    from trainer.rollout.hf import HFGenerator
    from trainer.tasks.chat import render_prompts

    task = cfg.task.build()
    gen = HFGenerator(model_dir, dtype=cfg.generation.dtype)
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
) -> list[dict[str, Any]]:
    """The (cell, seed) runs not in the cache with the current configuration, seed-major (an
    interrupted sweep then holds whole seeds of most cells)."""
    jobs = []
    for seed in seeds:
        for cell in cells:
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
) -> int:
    """The warm start (once), then every job; each result cached as it ends. Returns the
    number of failed runs."""
    _init_worker(threads)
    cache.warm = ensure_warm(base, sz, run_root)
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
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(threads,)
    ) as ex:
        futures = {ex.submit(run_cell, j): j for j in jobs}
        for fut in as_completed(futures):
            failed += _finish(cache, futures[fut], fut.result)
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


# -- per-run metrics at a target and a mu -------------------------------------------------------
def compute_of(point: list[float], mu: float) -> float:
    """Compute at a curve point ``[step, tokens, rollouts, uses, reward]``: learner passes over
    rollouts plus mu x generated rollouts (units: one learner pass over one rollout)."""
    return point[3] + mu * point[2]


def smoothed(rewards: list[float]) -> list[float]:
    """Centred 3-point moving average (2 points at the ends): one eval of a few hundred
    samples has a standard error of ~0.03, about a third of what RL gains here."""
    n = len(rewards)
    return [float(np.mean(rewards[max(0, i - 1) : i + 2])) for i in range(n)]


def hit(curve: list[list[float]], target: float) -> list[float] | None:
    """The first eval point whose smoothed reward (:func:`smoothed`) is >= target (None: never
    within the run)."""
    sm = smoothed([p[4] for p in curve])
    return next((p for p, r in zip(curve, sm) if r >= target), None)


def run_metrics(rec: dict[str, Any], target: float, mus: dict[str, float]) -> dict[str, float]:
    """One run's reported numbers (NaN where the target was not reached)."""
    h = hit(rec["curve"], target)
    out = {
        "tokens_to_target": h[1] if h else math.nan,
        "final_pass1": rec["pass1"],
        "final_pass4": rec["pass4"],
        "final_reward": rec["final_reward"],
        "heldout_entropy": rec["heldout_entropy"],
        "train_entropy": rec["train_entropy"],
        "tokens": rec["tokens"],
        "mu": rec["mu"],
    }
    for tag, mu in mus.items():
        out[f"compute_to_target@{tag}"] = compute_of(h, mu) if h else math.nan
    return out


# -- statistics ---------------------------------------------------------------------------------
def bootstrap_mean(
    values: list[float], n_boot: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap interval over ``values`` (NaNs dropped); one value: no
    interval (NaN bounds)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (n_boot, len(x)))].mean(axis=1)
    a = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def saving(
    base: dict[int, float],
    other: dict[int, float],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """``1 - mean(other) / mean(base)``: the share of ``base``'s cost that ``other`` saves, with a
    bootstrap interval. Paired by seed over the seeds where both are finite; with fewer than 2
    such seeds, unpaired (each side resampled on its own)."""

    def finite(d: dict[int, float]) -> dict[int, float]:
        return {s: v for s, v in d.items() if v is not None and not math.isnan(v)}

    def ratio_saving(o: np.ndarray, b: np.ndarray) -> np.ndarray:
        # A base mean of 0 (the target reached at the start): -inf, or 0 when both are 0.
        with np.errstate(divide="ignore", invalid="ignore"):
            out = 1 - np.asarray(o, dtype=float) / np.asarray(b, dtype=float)
        return np.where(np.isnan(out), 0.0, out)

    base, other = finite(base), finite(other)
    common = sorted(set(base) & set(other))
    rng = np.random.default_rng(seed)
    a = (1 - level) / 2
    if len(common) >= 2:
        b = np.array([base[s] for s in common])
        o = np.array([other[s] for s in common])
        idx = rng.integers(0, len(common), (n_boot, len(common)))
        boots = ratio_saving(o[idx].mean(axis=1), b[idx].mean(axis=1))
        point, paired, n = ratio_saving(o.mean(), b.mean()), True, len(common)
    elif len(base) >= 2 and len(other) >= 2:
        b, o = np.array(list(base.values())), np.array(list(other.values()))
        bi = rng.integers(0, len(b), (n_boot, len(b)))
        oi = rng.integers(0, len(o), (n_boot, len(o)))
        boots = ratio_saving(o[oi].mean(axis=1), b[bi].mean(axis=1))
        point, paired, n = ratio_saving(o.mean(), b.mean()), False, min(len(b), len(o))
    else:
        return {"point": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "paired": False}
    return {
        "point": float(point),
        "lo": float(np.quantile(boots, a, method="nearest")),
        "hi": float(np.quantile(boots, 1 - a, method="nearest")),
        "n": n,
        "paired": paired,
    }


# -- the report ---------------------------------------------------------------------------------
PANELS = [
    ("tokens_to_target", "generated tokens to target", ",.0f"),
    ("compute_to_target@measured", "compute to target (measured mu)", ",.0f"),
    ("compute_to_target@paper", f"compute to target (mu = {PAPER_MU})", ",.0f"),
    ("final_pass1", "final pass@1 (held-out)", ".3f"),
    ("final_pass4", "final pass@4 (held-out)", ".3f"),
    ("heldout_entropy", "held-out entropy (nats/token)", ".3f"),
]


def measured_mu(records: dict[Cell, dict[int, dict]]) -> float:
    mus = [r["mu"] for runs in records.values() for r in runs.values() if math.isfinite(r["mu"])]
    return float(np.median(mus)) if mus else math.nan


def summarise_cells(
    records: dict[Cell, dict[int, dict]], target: float, mu: float, n_boot: int = 10_000
) -> dict[Cell, dict[str, Any]]:
    """Per cell: per-seed metrics, and mean + 95% interval of each panel."""
    mus = {"measured": mu, "paper": PAPER_MU}
    out = {}
    for cell, runs in sorted(records.items()):
        per_seed = {s: run_metrics(r, target, mus) for s, r in sorted(runs.items())}
        stats = {}
        for key, _, _ in PANELS:
            stats[key] = bootstrap_mean([m[key] for m in per_seed.values()], n_boot)
        reached = sum(not math.isnan(m["tokens_to_target"]) for m in per_seed.values())
        out[cell] = {
            "per_seed": per_seed,
            "stats": stats,
            "seeds": len(per_seed),
            "reached": reached,
            "mu": float(np.median([m["mu"] for m in per_seed.values()])),
            "tokens": float(np.mean([m["tokens"] for m in per_seed.values()])),
        }
    return out


def best_cells(summ: dict[Cell, dict[str, Any]], key: str, k: int = 1) -> list[Cell]:
    """The ``k`` replay cells with the lowest mean ``key`` among those whose every seed (and at
    least 2) reached the target."""
    ok = [
        c
        for c, s in summ.items()
        if not c.onpolicy and s["seeds"] >= 2 and s["reached"] == s["seeds"]
    ]
    return sorted(ok, key=lambda c: summ[c]["stats"][key][0])[:k]


def savings(summ: dict[Cell, dict[str, Any]], n_boot: int = 10_000) -> list[dict[str, Any]]:
    """For each mu: the best replay cell by mean compute to target and its saving vs on-policy
    (also its token saving)."""
    if ONPOLICY not in summ:
        return []
    on = summ[ONPOLICY]["per_seed"]
    out = []
    for tag in ("measured", "paper"):
        key = f"compute_to_target@{tag}"
        best = best_cells(summ, key)
        if not best:
            out.append({"mu": tag, "cell": None})
            continue
        rep = summ[best[0]]["per_seed"]
        out.append(
            {
                "mu": tag,
                "cell": best[0],
                "compute": saving(
                    {s: m[key] for s, m in on.items()}, {s: m[key] for s, m in rep.items()}, n_boot
                ),
                "tokens": saving(
                    {s: m["tokens_to_target"] for s, m in on.items()},
                    {s: m["tokens_to_target"] for s, m in rep.items()},
                    n_boot,
                ),
            }
        )
    return out


def sensitivity(
    records: dict[Cell, dict[int, dict]], target: float, mu: float, n_boot: int = 2000
) -> str:
    """The best replay cell and its compute saving vs on-policy at targets around ``target``
    (-inf: on-policy reached that target at the start on some seed, at zero compute)."""
    rows = [
        "| target | on-policy reached | best at measured mu: saving | best at mu = 5.3: saving |",
        "|---|---|---|---|",
    ]
    for t in (target - 0.04, target - 0.02, target, target + 0.02):
        summ = summarise_cells(records, t, mu, n_boot)
        on = summ.get(ONPOLICY)
        cols = []
        for b in savings(summ, n_boot):
            cols.append(f"{b['cell'].name}: {fmt_pct(b['compute'])}" if b["cell"] else "none")
        reached = f"{on['reached']}/{on['seeds']}" if on else "-"
        rows.append(f"| {t:.2f} | {reached} | " + " | ".join(cols or ["-", "-"]) + " |")
    return "\n".join(rows) + "\n"


def fmt_ci(stat: tuple[float, float, float], spec: str) -> str:
    mean, lo, hi = stat
    if math.isnan(mean):
        return "-"
    if math.isnan(lo):
        return format(mean, spec)
    return f"{format(mean, spec)} [{format(lo, spec)}, {format(hi, spec)}]"


def fmt_pct(s: dict[str, Any]) -> str:
    if math.isnan(s["point"]):
        return "-"

    def pct(x: float) -> str:
        return f"{100 * x:.0f}%" if math.isfinite(x) else "-inf"

    how = "paired" if s["paired"] else "unpaired"
    return f"{pct(s['point'])} [{pct(s['lo'])}, {pct(s['hi'])}] ({how}, {s['n']} seeds)"


def table(summ: dict[Cell, dict[str, Any]], sz: Sizing) -> str:
    cols = [label for _, label, _ in PANELS]
    head = (
        "| cell | y | N (rows) | seeds | reached | tokens used | "
        + " | ".join(cols)
        + " | mu |\n|"
        + "---|" * (len(cols) + 7)
        + "\n"
    )
    rows = []
    for cell, s in summ.items():
        vals = " | ".join(fmt_ci(s["stats"][k], spec) for k, _, spec in PANELS)
        rows.append(
            f"| {cell.label()} | {cell.y} | {cell.n}x ({cell.n * sz.rollouts_per_round}) "
            f"| {s['seeds']} | {s['reached']}/{s['seeds']} | {s['tokens']:,.0f} | {vals} "
            f"| {s['mu']:.2f} |"
        )
    return head + "\n".join(rows) + "\n"


def plot_panels(summ: dict[Cell, dict[str, Any]], path: Path, target: float) -> None:
    """One panel per metric: ppo cells against y (a line per N), the y = 8 loss variants
    beside them, on-policy as a dashed line; error bars are the 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    variants = [c for c in summ if not (c.loss == "ppo" and c.epochs == 1)]
    for ax, (key, label, _) in zip(axes.flat, PANELS):
        for i, n in enumerate(sorted({c.n for c in summ if c.loss == "ppo" and c.epochs == 1})):
            cells = sorted(
                (c for c in summ if c.loss == "ppo" and c.epochs == 1 and c.n == n),
                key=lambda c: c.y,
            )
            xs = [c.y * (1 + 0.04 * (i - 1)) for c in cells]
            st = [summ[c]["stats"][key] for c in cells]
            ax.errorbar(
                xs,
                [s[0] for s in st],
                yerr=_yerr(st),
                marker="o",
                ms=4,
                capsize=3,
                label=f"ppo, N = {n}x",
            )
        for j, c in enumerate(variants):
            s = summ[c]["stats"][key]
            ax.errorbar(
                [c.y * (1.12 + 0.05 * j)],
                [s[0]],
                yerr=_yerr([s]),
                marker="s^Dv"[j % 4],
                ms=5,
                capsize=3,
                ls="none",
                label=c.name,
            )
        if ONPOLICY in summ:
            m, lo, hi = summ[ONPOLICY]["stats"][key]
            ax.axhline(m, color="grey", ls="--", lw=1)
            if not math.isnan(lo):
                ax.axhspan(lo, hi, color="grey", alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replay ratio y")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"carry_add, tiny model: mean and 95% bootstrap interval over seeds "
                 f"(target {target}; dashed: on-policy)")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _yerr(stats: list[tuple[float, float, float]]) -> np.ndarray:
    lo = [m - lo if not math.isnan(lo) else 0.0 for m, lo, _ in stats]
    hi = [hi - m if not math.isnan(hi) else 0.0 for m, _, hi in stats]
    return np.array([lo, hi])


def plot_curves(
    records: dict[Cell, dict[int, dict]],
    cells: list[Cell],
    path: Path,
    mu: float,
    target: float,
) -> None:
    """Held-out reward against compute for ``cells``, at the measured ``mu`` (left) and at
    mu = 5.3 (right): the seeds' mean curve (each seed interpolated onto a common grid up to
    the shortest seed's end) over the seeds' own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, m in zip(axes, (mu, PAPER_MU)):
        for i, cell in enumerate(cells):
            runs = records.get(cell, {})
            if not runs:
                continue
            color = f"C{i}"
            curves = []
            for r in runs.values():
                xs = [compute_of(p, m) for p in r["curve"]]
                ys = [p[4] for p in r["curve"]]
                ax.plot(xs, ys, color=color, alpha=0.15, lw=1)
                curves.append((xs, ys))
            grid = np.linspace(0, min(xs[-1] for xs, _ in curves), 40)
            mean = np.mean([np.interp(grid, xs, ys) for xs, ys in curves], axis=0)
            ax.plot(grid, mean, color=color, lw=2, label=f"{cell.label()} ({len(runs)} seeds)")
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.set_xlabel(f"compute (learner passes over rollouts + {m:.2f} x generated rollouts)")
        ax.set_ylabel("held-out reward (trainer eval)")
        ax.set_title(f"mu = {m:.2f}" + (" (measured)" if m == mu else " (paper)"), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(
    cache: Cache,
    hashes: dict[str, str],
    sz: Sizing,
    *,
    target: float,
    out: Path,
    command: str,
    n_boot: int = 10_000,
    pilot: bool = False,
) -> str:
    """Write the sweep's block of ``out`` (tables, savings, figures) and return it."""
    records = cache.records(hashes)
    if not records:
        raise SystemExit(
            "no cached runs match the current configuration: nothing to report (pass the "
            "sizing options the sweep ran with, e.g. --budget-rounds)"
        )
    mu = measured_mu(records)
    summ = summarise_cells(records, target, mu, n_boot)
    runs = sum(len(r) for r in records.values())
    wall = sum(s.get("seconds", 0.0) for s in cache.sessions)
    run_s = [r["wall_s"] for rr in records.values() for r in rr.values()]
    all_mu = [r["mu"] for rr in records.values() for r in rr.values()]
    stem = out.stem + ("_pilot" if pilot else "_sweep")
    panels_png = out.with_name(f"{stem}_panels.png")
    curves_png = out.with_name(f"{stem}_curves.png")
    lines = [
        "Runs: "
        + "; ".join(
            f"`{' '.join(['python tools/replay_sweep.py', *map(shlex.quote, se['argv'])])}` "
            f"({se['runs']} runs, {se['seconds'] / 60:.0f} min)"
            for se in cache.sessions
        )
        + f". Report: `{command}`"
        + (" (**pilot**: too few seeds and runs to conclude)" if pilot else "")
        + ".",
        "",
        f"{runs} runs in {len(records)} cells; sweep wall time {wall / 60:.0f} min over "
        f"{len(cache.sessions)} session(s); per run {np.median(run_s):.0f} s median "
        f"({min(run_s):.0f}-{max(run_s):.0f}). Target: first eval whose 3-eval moving "
        f"average of held-out reward is >= {target}. Budget: compute of {sz.budget_rounds} on-policy rounds at mu = "
        f"{sz.mu_budget} per run. Measured mu (generation / training cost per rollout, median "
        f"over runs): **{mu:.2f}** (runs' range {min(all_mu):.2f}-{max(all_mu):.2f}).",
        "",
    ]
    w = cache.warm
    if w:
        lines += [
            f"Start (all runs): the supervised warm start of {sz.warm_steps} steps, held-out "
            f"pass@1 {w['pass1']:.3f}, pass@4 {w['pass4']:.3f}, entropy "
            f"{w['heldout_entropy']:.3f} nats/token, {w['heldout_tokens']:.1f} tokens per "
            "completion.",
            "",
        ]
    lines += [
        "Mean [95% bootstrap interval over seeds]; to-target columns average the seeds that "
        "reached the target (`reached`). Compute unit: one learner pass over one rollout.",
        "",
        table(summ, sz),
    ]
    best = savings(summ, n_boot)
    for b in best:
        tag = f"mu = {mu:.2f} (measured)" if b["mu"] == "measured" else f"mu = {PAPER_MU}"
        if b["cell"] is None:
            lines.append(f"* {tag}: no replay cell reached the target on every seed.")
            continue
        lines.append(
            f"* {tag}: best replay cell **{b['cell'].name}**; compute to {target} vs "
            f"on-policy: saving {fmt_pct(b['compute'])}; generated tokens: saving "
            f"{fmt_pct(b['tokens'])}."
        )
    lines += ["", sensitivity(records, target, mu, n_boot)]
    lines += [
        "",
        "(The best cell is picked on the same runs, so its saving is optimistic; seeds 5+ "
        "of phase 2 are the check.)",
        "",
        f"![panels]({panels_png.name})",
        "",
        f"![reward vs compute]({curves_png.name})",
        "",
    ]
    plot_panels(summ, panels_png, target)
    # On-policy, the best replay cells, and the y axis at N = 4x (the losses' buffer).
    shown = [ONPOLICY] + best_cells(summ, "compute_to_target@measured", 3)
    shown += [c for c in summ if c.n == 4 and c.loss == "ppo" and c.epochs == 1]
    shown = list(dict.fromkeys(c for c in shown if c in summ))
    plot_curves(records, shown, curves_png, mu, target)
    block = "\n".join(lines)
    head = (
        "# Replay ratio x buffer size: compute to reach a target accuracy\n\n"
        f"See the docstring of `tools/replay_sweep.py` ([paper]({PAPER})).\n\n"
    )
    text = out.read_text() if out.exists() else ""
    tail = "\n## Reading\n\n(to write from the tables above)\n"
    if text and SWEEP_BEGIN not in text:
        tail += "\n---\n\n" + text  # the earlier report stays below, to edit by hand
    _write_report(out, block, head, tail, markers=(SWEEP_BEGIN, SWEEP_END))
    return block


# -- planning -----------------------------------------------------------------------------------
def cost_model(cache: Cache) -> dict[str, float]:
    """Per-rollout and per-pass costs from the cached runs (else the pilot's)."""
    recs = [r for r in cache.runs.values() if r.get("schema", SCHEMA) == SCHEMA]
    if not recs:
        return dict(PILOT, source="pilot constants (PILOT)")
    cpu = [r["cpu_s"] / r["wall_s"] for r in recs if "cpu_s" in r]
    return {
        # CPU seconds / wall seconds of the runs: well below 1 when other jobs took the cores.
        "cpu_share": float(np.median(cpu)) if cpu else PILOT["cpu_share"],
        "gen_s_per_rollout": float(np.median([r["gen_seconds"] / r["rollouts"] for r in recs])),
        "train_s_per_pass": float(np.median([r["train_seconds"] * 64 / r["uses"] for r in recs])),
        "overhead_s": float(
            np.median([r["wall_s"] - r["gen_seconds"] - r["train_seconds"] for r in recs])
        ),
        "warm_s": cache.warm.get("seconds", PILOT["warm_s"]),
        "source": f"{len(recs)} cached runs",
    }


def estimate_seconds(cell: Cell, sz: Sizing, cm: dict[str, float]) -> float:
    rounds = sz.rounds(cell)
    passes = rounds * sz.updates_per_round(cell) * cell.epochs * sz.batch_size / 64
    return (
        cm["overhead_s"]
        + rounds * sz.rollouts_per_round * cm["gen_s_per_rollout"]
        + passes * cm["train_s_per_pass"]
    )


def schedule(durations: list[float], workers: int) -> float:
    """Wall time of running ``durations`` longest first on ``workers`` slots."""
    loads = [0.0] * max(1, workers)
    for d in sorted(durations, reverse=True):
        loads[loads.index(min(loads))] += d
    return max(loads)


def plan(
    cells: list[Cell], seeds: list[int], sz: Sizing, cache: Cache, hashes: dict, workers: int
) -> str:
    cm = cost_model(cache)
    R = sz.rollouts_per_round
    lines = [
        f"R = {R} rollouts per round, B = {sz.batch_size}; budget = compute of "
        f"{sz.budget_rounds} on-policy rounds at mu = {sz.mu_budget}; {sz.evals} evals x "
        f"{sz.eval_prompts} prompts; pass@k on {sz.passk_prompts} prompts x "
        f"{sz.passk_samples} samples; warm start {sz.warm_steps} steps",
        f"costs from {cm['source']}: gen {cm['gen_s_per_rollout'] * 1e3:.1f} ms/rollout, "
        f"learner {cm['train_s_per_pass']:.3f} s/pass of 64, overhead {cm['overhead_s']:.0f} "
        f"s/run, warm start {cm['warm_s']:.0f} s (once)",
        "",
        f"{'cell':<16} {'upr':>4} {'window':>6} {'rounds':>6} {'steps':>5} {'~tokens':>8} "
        f"{'est s':>6}  seeds (cached *)",
    ]
    pending = []
    for cell in cells:
        est = estimate_seconds(cell, sz, cm)
        marks = []
        for s in seeds:
            done = hashes.get(Cache.key(cell, s)) and cache.done(
                cell, s, hashes[Cache.key(cell, s)]
            )
            marks.append(f"{s}{'*' if done else ''}")
            if not done:
                pending.append(est)
        lines.append(
            f"{cell.name:<16} {sz.updates_per_round(cell):>4} {cell.n * R:>6} "
            f"{sz.rounds(cell):>6} {sz.rounds(cell) * sz.updates_per_round(cell):>5} "
            f"{sz.rounds(cell) * R * 27:>8,} {est:>6.0f}  {' '.join(marks)}"
        )
    warm_s = 0.0 if cache.warm.get("spec", {}).get("steps") == sz.warm_steps else cm["warm_s"]
    wall = warm_s + schedule(pending, workers)
    total = len(cells) * len(seeds)
    lines += [
        "",
        f"{total} runs, {len(pending)} to run ({total - len(pending)} cached), "
        f"estimated wall time with --jobs {workers}: {wall / 60:.0f} min",
    ]
    replay = sorted(estimate_seconds(c, sz, cm) for c in cells if not c.onpolicy)
    in_all = wall
    if ONPOLICY in cells and len(replay) >= 2:
        # Phase 2: 3 more seeds of on-policy and of two replay cells (at the median cost).
        extra = [estimate_seconds(ONPOLICY, sz, cm)] + [replay[len(replay) // 2]] * 2
        p2 = schedule(extra * 3, workers)
        in_all += p2
        lines.append(
            f"phase 2 (--cells onpolicy best2 --seeds 5 6 7): 9 runs, about {p2 / 60:.0f} min "
            f"more; in all about {in_all / 60:.0f} min"
        )
    if cm.get("loaded"):
        lines.append("(pilot costs were measured while other jobs shared the machine)")
    if cm["cpu_share"] < 0.8:
        idle = in_all * max(cm["cpu_share"], 0.1)
        lines.append(
            f"the cached runs had {cm['cpu_share']:.0%} of a core each (CPU / wall seconds): "
            f"with a core per run (an otherwise idle machine) about {idle / 60:.0f} min"
        )
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------
def select_cells(tokens: list[str], cache: Cache, hashes_for, target: float) -> list[Cell]:
    """Cell names, globs (``ppo-y*-n4``), ``all``, ``onpolicy``, ``best`` / ``bestK`` (the K best
    replay cells by compute to target at the measured mu, from the cache)."""
    out: list[Cell] = []
    names = {c.name: c for c in GRID}
    for tok in tokens:
        if tok == "all":
            got = list(GRID)
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
                raise SystemExit(f"{tok}: matches no cell of the grid")
        else:
            got = [parse_cell(tok)]
        out += [c for c in got if c not in out]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arith.toml", help="base")
    ap.add_argument("--cells", nargs="+", default=["all"], help="names, globs, all, best2")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs/sweep")
    ap.add_argument("--cache", type=Path, default=None, help="default RUN_ROOT/cache.json")
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
    args = ap.parse_args(argv)
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

    cells = select_cells(args.cells, cache, hashes_for, args.target)
    if args.report:
        cached_cells = sorted({parse_cell(r["cell"]) for r in cache.runs.values()})
        hashes = hashes_for(cached_cells)
        stale = sum(1 for k, r in cache.runs.items() if hashes.get(k) != r.get("hash"))
        if stale:
            print(f"note: {stale} cached runs have another configuration; left out")
        cmd = " ".join(["python tools/replay_sweep.py"] + [
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
        ])  # fmt: skip
        block = report(
            cache, hashes, sz, target=args.target, out=args.out, command=cmd,
            n_boot=args.bootstrap, pilot=args.pilot,
        )  # fmt: skip
        print(block)
        return 0
    if args.plan:
        print(plan(cells, args.seeds, sz, cache, hashes_for(cells, args.seeds), args.jobs))
        return 0
    jobs = make_jobs(base, cells, args.seeds, sz, args.run_root, cache, keep=args.keep_runs)
    print(f"{len(jobs)} runs to do ({len(cells) * len(args.seeds) - len(jobs)} cached)")
    if not jobs:
        return 0
    t0 = time.perf_counter()
    cache.begin_session(sys.argv[1:] if argv is None else list(argv), args.jobs)
    try:
        failed = run_jobs(
            jobs, cache, base=base, sz=sz, run_root=args.run_root, workers=args.jobs,
            threads=args.threads,
        )  # fmt: skip
    finally:
        cache.tick()
        cache.save()
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
