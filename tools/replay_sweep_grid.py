"""The grid of the replay sweep: its cells, the sizing of a run, each run's ``TrainConfig``, the
cache of finished runs, and ``--plan``'s cost estimate.

Shared by the runner (``tools/replay_sweep.py``: the command to run, whose docstring describes
the sweep) and the report (``tools/replay_sweep_report.py``); nothing to run here::

    python tools/replay_sweep.py --plan --jobs 2        # the grid, its runs, the estimated time

These definitions live apart from the runner because the runner is also the script
(``__main__``): a ``Cell`` class defined there would exist twice, once per module name, and the
report's ``ONPOLICY in records`` would miss the script's cells.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools import carry_task  # registers the task
from tools.replay_common import copy_sections

PAPER = "https://arxiv.org/abs/2604.08706"
PAPER_MU = 5.3  # the paper's generation / training cost per rollout for Qwen2.5-7B
SCHEMA = 1  # bump when what a cached record means changes
PASSK_SEED = 424_242  # the held-out pass@k prompt set and its sampling seed: one for all runs
LOSSES = ("ppo", "tis", "asymre", "m2po")

# The task and model every cell shares, over the base config (examples/arith.toml).
TASK = {
    "task": {"name": carry_task.NAME, "options": {"min_digits": 2, "max_digits": 3}},
    "generation": {"backend": "hf", "max_tokens": 40},
}


# Pilot (see the docstring of tools/replay_sweep.py): per-rollout and per-step costs that --plan
# uses until the cache holds runs of its own. Measured with 2 runs in parallel, 1 torch thread
# each.
PILOT = {
    "gen_s_per_rollout": 0.0168,  # sampling + scoring + embedding + store append
    "train_s_per_pass": 0.99,  # one learner pass over a batch of 64 (the draw + the step)
    "overhead_s": 62.0,  # start, model load, evals, checkpoint, pass@k sampling
    "warm_s": 69.0,  # the warm start (once)
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
    d["eval"] = {"prompts": sz.eval_prompts, "every": sz.eval_every_rounds(cell) * upr}
    d["generation"].update(prompts_per_round=sz.prompts_per_round, group_size=sz.group_size)
    d["run"].update(
        dir=str(run_root / cell.name / f"s{seed}"),
        seed=seed,
        steps=steps,
        updates_per_round=upr,
        batch_size=sz.batch_size,
        warm_start_steps=0,  # done once for all runs: warm_dir()
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
    """``--plan``: the sizing, a row per cell (its runs and estimated seconds, the cached
    seeds starred) and the estimated wall time of what is left, phase 2 and an idle machine."""
    cm = cost_model(cache)
    lines = [
        f"R = {sz.rollouts_per_round} rollouts per round, B = {sz.batch_size}; budget = compute "
        f"of {sz.budget_rounds} on-policy rounds at mu = {sz.mu_budget}; {sz.evals} evals x "
        f"{sz.eval_prompts} prompts; pass@k on {sz.passk_prompts} prompts x "
        f"{sz.passk_samples} samples; warm start {sz.warm_steps} steps",
        f"costs from {cm['source']}: gen {cm['gen_s_per_rollout'] * 1e3:.1f} ms/rollout, "
        f"learner {cm['train_s_per_pass']:.3f} s/pass of 64, overhead {cm['overhead_s']:.0f} "
        f"s/run, warm start {cm['warm_s']:.0f} s (once)",
        "",
        f"{'cell':<16} {'upr':>4} {'window':>6} {'rounds':>6} {'steps':>5} {'~tokens':>8} "
        f"{'est s':>6}  seeds (cached *)",
    ]
    pending: list[float] = []
    for cell in cells:
        lines.append(_plan_row(cell, seeds, sz, cache, hashes, cm, pending))
    warm_s = 0.0 if cache.warm.get("spec", {}).get("steps") == sz.warm_steps else cm["warm_s"]
    wall = warm_s + schedule(pending, workers)
    total = len(cells) * len(seeds)
    lines += [
        "",
        f"{total} runs, {len(pending)} to run ({total - len(pending)} cached), "
        f"estimated wall time with --jobs {workers}: {wall / 60:.0f} min",
    ]
    return "\n".join(lines + _plan_notes(cells, sz, cm, wall, workers))


def _plan_row(
    cell: Cell,
    seeds: list[int],
    sz: Sizing,
    cache: Cache,
    hashes: dict,
    cm: dict[str, float],
    pending: list[float],
) -> str:
    """``cell``'s line of the plan; the estimate of each of its uncached runs goes to
    ``pending``."""
    est = estimate_seconds(cell, sz, cm)
    marks = []
    for s in seeds:
        done = hashes.get(Cache.key(cell, s)) and cache.done(cell, s, hashes[Cache.key(cell, s)])
        marks.append(f"{s}{'*' if done else ''}")
        if not done:
            pending.append(est)
    R, upr, rounds = sz.rollouts_per_round, sz.updates_per_round(cell), sz.rounds(cell)
    # ~27 tokens per completion: the warm-started model's length (module docstring).
    return (
        f"{cell.name:<16} {upr:>4} {cell.n * R:>6} {rounds:>6} {rounds * upr:>5} "
        f"{rounds * R * 27:>8,} {est:>6.0f}  {' '.join(marks)}"
    )


def _plan_notes(
    cells: list[Cell], sz: Sizing, cm: dict[str, float], wall: float, workers: int
) -> list[str]:
    """The plan's closing lines: phase 2's time, and the time on an otherwise idle machine
    when the costs were measured on a loaded one."""
    lines = []
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
    return lines
