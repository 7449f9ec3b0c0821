"""The grid of the replay sweep: its cells, the sizing of a run, each run's ``TrainConfig``, the
cache of finished runs, and ``--plan``'s cost estimate.

A cell's name says what it sets (parsed by ``CELL_RE``; ``parse_cell(cell.name) == cell``)::

    LOSS[-epE][-posP]-yY-nN[-sK][-lrX]      e.g. ppo-y4-n4, asymre-pos50-y4-n16, ppo-y4-n16-s8-lr5e-5

``LOSS``: ``[loss] loss_type``; ``-epE``: ``[optim] ppo_epochs``; ``-posP``: positive-bias
sampling, ``positive_fraction = P / 100`` of each batch from the freshest ``P / 100 x N`` correct
rows of the window (``positive_pool``); ``yY``: replay ratio; ``nN``: the FIFO window in rounds;
``-sK``: ``[replay] max_staleness = K`` policy versions; ``-lrX``: ``[optim] lr`` (without it, the
sizing's ``--lr``: the names, configs and cache keys of the first sweep's cells are unchanged).

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
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from tools import carry_task  # registers the task
from tools.replay_common import copy_sections

PAPER = "https://arxiv.org/abs/2604.08706"
PAPER_MU = 5.3  # the paper's generation / training cost per rollout for Qwen2.5-7B
SCHEMA = 1  # bump when what a cached record means changes
WARM_FIGURES = ("pass1", "pass4", "heldout_entropy", "heldout_tokens")  # without a weights hash
# The tiny model's warm start, tracked (1.8 MB): every machine starts the sweep from these weights.
# A rebuilt one differs from machine to machine (the 250 supervised steps round differently on
# another CPU's kernels), so the runs of a cache must not mix starts rebuilt on two machines.
WARM_KEPT = Path(__file__).resolve().parents[1] / "docs/data/replay_sweep_warm"
PASSK_SEED = 424_242  # the held-out pass@k prompt set and its sampling seed: one for all runs
LOSSES = ("ppo", "tis", "asymre", "m2po")
ASYMRE_DELTA = -0.1  # the paper's delta V for AsymRE (also trainer.algo.loss_config's default)

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
@dataclass(frozen=True)
class Cell:
    loss: str
    y: int  # learner passes per generated rollout
    n: int  # FIFO window in rounds' worth of rollouts
    epochs: int = 1  # [optim] ppo_epochs
    pos: int = 0  # positive-bias sampling: percent of each batch from the freshest correct rows
    cap: int | None = None  # [replay] max_staleness, in policy versions (learner steps)
    lr: float | None = None  # [optim] lr (None: the sizing's lr)

    def __post_init__(self) -> None:
        if not 0 <= self.pos <= 100:
            raise ValueError(f"Cell.pos is a percent in [0, 100], got {self.pos!r}")
        if self.cap is not None and self.cap < 0:
            raise ValueError(f"Cell.cap (max_staleness) must be >= 0 or None, got {self.cap!r}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"Cell.lr must be a positive number or None, got {self.lr!r}")

    @property
    def name(self) -> str:
        ep = f"-ep{self.epochs}" if self.epochs > 1 else ""
        pos = f"-pos{self.pos}" if self.pos else ""
        cap = f"-s{self.cap}" if self.cap is not None else ""
        lr = f"-lr{lr_name(self.lr)}" if self.lr is not None else ""
        return f"{self.loss}{ep}{pos}-y{self.y}-n{self.n}{cap}{lr}"

    @property
    def onpolicy(self) -> bool:
        """Each rollout used once, in its round (at any lr)."""
        return (self.loss, self.y, self.n, self.epochs, self.pos, self.cap) == (
            ("ppo", 1, 1, 1, 0, None)
        )

    @property
    def plain(self) -> bool:
        """Clipped PPO over the FIFO buffer alone: one epoch, no positive bias, no cap."""
        return self.loss == "ppo" and self.epochs == 1 and not self.pos and self.cap is None

    @property
    def base(self) -> Cell:
        """This cell at the sizing's lr (the cell a tuned lr belongs to)."""
        return replace(self, lr=None)

    def at(self, lr: float | None) -> Cell:
        return replace(self, lr=lr)

    def label(self) -> str:
        return f"{self.name} (on-policy)" if self.onpolicy else self.name

    def _key(self) -> tuple:
        # None sorts first (a plain tuple comparison of None with a number raises).
        return (self.loss, self.y, self.n, self.epochs, self.pos,
                -1 if self.cap is None else self.cap, 0.0 if self.lr is None else self.lr)  # fmt: skip

    def __lt__(self, other: Cell) -> bool:
        return self._key() < other._key()


def lr_name(lr: float) -> str:
    """``lr`` as a name's suffix: the shortest digits that read back as the same float
    (``2.5e-5``, ``1e-4``)."""
    return format(Decimal(repr(float(lr))).normalize(), "e")


CELL_RE = re.compile(
    r"^(?P<loss>[a-z0-9]+)(?:-ep(?P<ep>\d+))?(?:-pos(?P<pos>\d+))?-y(?P<y>\d+)-n(?P<n>\d+)"
    r"(?:-s(?P<cap>\d+))?(?:-lr(?P<lr>\d+(?:\.\d+)?(?:e[-+]?\d+)?))?$"
)


def parse_cell(name: str) -> Cell:
    if name == "onpolicy":
        return ONPOLICY
    m = CELL_RE.match(name)
    if not m or m["loss"] not in LOSSES:
        raise ValueError(
            f"not a cell name: {name!r} (e.g. ppo-y4-n4, ppo-ep4-y8-n4, asymre-pos50-y4-n16, "
            "ppo-y4-n16-s8, ppo-y4-n4-lr5e-5, onpolicy)"
        )
    cap = int(m["cap"]) if m["cap"] is not None else None
    lr = float(m["lr"]) if m["lr"] is not None else None
    return Cell(m["loss"], int(m["y"]), int(m["n"]), int(m["ep"] or 1), int(m["pos"] or 0), cap, lr)


ONPOLICY = Cell("ppo", 1, 1)
GRID = [Cell("ppo", y, n) for y in (1, 2, 4, 8, 16) for n in (1, 4, 16)] + [
    Cell("tis", 8, 4),
    Cell("asymre", 8, 4),
    Cell("m2po", 8, 4),
    Cell("ppo", 8, 4, epochs=4),
]
# The paper's best buffer (issue #30): positive-bias sampling (delta = 25% or 50% of each batch
# from the freshest delta x N correct rows) with AsymRE and with PPO, at y in {2, 4} and N in
# {4, 16}; and a staleness cap at y = 4. With a fixed R per round and one policy version per
# learner step, a cap of K versions keeps the rows of the last K / y to K / y + 1 rounds: K = 8
# at y = 4 is a 2-3 round horizon, between the grid's n1 and n4.
PAPER_CELLS = [
    Cell(loss, y, n, pos=pos)
    for loss in ("asymre", "ppo")
    for pos in (25, 50)
    for y in (2, 4)
    for n in (4, 16)
] + [Cell("ppo", 4, 16, cap=8)]
GROUPS = {"all": GRID, "paper": PAPER_CELLS}


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
    # "warm": the tiny model on carry_add after the supervised warm start (the sweep's own
    # setting); "base": the --config's own model (a real pretrained one, LoRA as it says) and
    # task, as they are: no warm start (issue #30 item 4).
    start: str = "warm"

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
    upr = sz.updates_per_round(cell)
    steps = sz.rounds(cell) * upr
    R = sz.rollouts_per_round
    every = {"prompts": sz.eval_prompts, "every": sz.eval_every_rounds(cell) * upr}
    if start_from_base(sz):  # the config's model, task and eval settings (greedy, ...)
        path = Path(d["model"]["path"])
        if not path.is_dir():  # a relative folder resolves from here; no hub names offline
            raise ValueError(f"--start base: [model] path {str(path)!r} is not a model folder")
        d["model"]["path"] = str(path.resolve())
        d["eval"] = {**d.get("eval", {}), **every}
    else:
        for section, values in TASK.items():
            d.setdefault(section, {}).update(copy_sections(values))
        d["model"]["path"] = str(warm_dir(run_root))
        d["eval"] = every
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
    # The FIFO buffer alone: no staleness or use cap (the window bounds both), unless the cell
    # sets one; keys are only added when set, so the first sweep's configs hash as before.
    d["replay"] = {"window": cell.n * R, "seed": seed, "priority": "uniform", "diversity": "none"}
    if cell.pos:
        # The paper's positive bias: a share delta of each batch from the freshest delta x N
        # correct rows (reward > 0) of the window, the rest uniform over the window.
        d["replay"].update(
            positive_fraction=cell.pos / 100, positive_pool=cell.n * R * cell.pos // 100
        )
    if cell.cap is not None:
        d["replay"]["max_staleness"] = cell.cap
    d["loss"]["loss_type"] = cell.loss
    if cell.loss == "asymre":
        d["loss"]["asymre_delta"] = ASYMRE_DELTA
    lr = sz.lr if cell.lr is None else cell.lr
    d.setdefault("optim", {}).update(lr=lr, ppo_epochs=cell.epochs, mini_batches=1, seed=seed)
    return TrainConfig.from_dict(d)


def config_hash(cfg: Any, sz: Sizing) -> str:
    """What a cached result depends on: the config (less its folders), warm start and pass@k."""
    d = cfg.to_dict()
    d["run"]["dir"] = d["model"]["path"] = ""
    extra = {
        "warm": "base" if start_from_base(sz) else [sz.warm_steps, sz.warm_lr, sz.warm_seed],
        "passk": [sz.passk_prompts, sz.passk_samples, PASSK_SEED],
        "schema": SCHEMA,
    }
    blob = json.dumps({"config": d, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_dir(run_root: Path) -> Path:
    return run_root / "warm"


def weights_digest(folder: Path) -> str:
    """A model folder's identity: the SHA-256 of its ``*.safetensors`` files, in name order."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def machine() -> dict[str, Any]:
    """Where a run ran: the CPU (model, the vector extensions torch dispatches on), its cores and
    the torch build. Runs of one cell on two machines from the same warm start are replicates:
    their floating-point rounding differs, as a seed does, so a cache may hold both."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "capability": torch.backends.cpu.get_cpu_capability(),  # e.g. AVX2, AVX512
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def start_from_base(sz: Sizing) -> bool:
    """Whether runs start from the --config's own model (``--start base``) or the warm start."""
    if sz.start not in ("warm", "base"):
        raise ValueError(f"--start {sz.start!r}: 'warm' (the tiny model's warm start) or 'base'")
    return sz.start == "base"


def _same(a: Any, b: Any) -> bool:
    """Equal, counting NaN equal to NaN (pass@4 with fewer than 4 samples)."""
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


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
        self.sessions.append(
            {"argv": argv, "jobs": jobs, "seconds": 0.0, "runs": 0, "machine": machine()}
        )
        self.save()

    def tick(self, ran: int = 0) -> None:
        if getattr(self, "_t0", None) is not None:
            self.sessions[-1]["seconds"] = time.perf_counter() - self._t0
            self.sessions[-1]["runs"] += ran

    def adopt_warm(self, info: dict[str, Any]) -> None:
        """Take the warm start's info (``ensure_warm``); refuse one with the same spec that is
        not the start the cached runs had: other weights (their hash), or for a cache from
        before weights were hashed, other held-out figures (a warm start rebuilt elsewhere)."""
        old = self.warm
        if old.get("spec") == info.get("spec"):
            if "weights" in old:
                if old["weights"] != info.get("weights"):
                    raise SystemExit(
                        f"{self.path}: the warm start here (weights {info.get('weights')}) is "
                        f"not the one its cached runs started from (weights {old['weights']}); "
                        f"take the tracked one (--warm-from, default {WARM_KEPT.name}) or "
                        "start a new --cache"
                    )
                self.warm = info
                return
            diff = [k for k in WARM_FIGURES if k in old and not _same(old[k], info.get(k))]
            if diff:
                got = ", ".join(f"{k} {old[k]!r} -> {info.get(k)!r}" for k in diff)
                raise SystemExit(
                    f"{self.path}: the warm start rebuilt here is not the one its cached runs "
                    f"started from ({got}); resume on the machine and torch build that made "
                    "the cache, or start a new --cache"
                )
        self.warm = info

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
    w = max([16] + [len(c.name) for c in cells])
    lines = [
        f"R = {sz.rollouts_per_round} rollouts per round, B = {sz.batch_size}; budget = compute "
        f"of {sz.budget_rounds} on-policy rounds at mu = {sz.mu_budget}; {sz.evals} evals x "
        f"{sz.eval_prompts} prompts; pass@k on {sz.passk_prompts} prompts x "
        f"{sz.passk_samples} samples; warm start {sz.warm_steps} steps",
        f"costs from {cm['source']}: gen {cm['gen_s_per_rollout'] * 1e3:.1f} ms/rollout, "
        f"learner {cm['train_s_per_pass']:.3f} s/pass of 64, overhead {cm['overhead_s']:.0f} "
        f"s/run, warm start {cm['warm_s']:.0f} s (once)",
        "",
        f"{'cell':<{w}} {'upr':>4} {'window':>6} {'rounds':>6} {'steps':>5} {'~tokens':>8} "
        f"{'est s':>6}  seeds (cached *)",
    ]
    pending: list[float] = []
    for cell in cells:
        lines.append(_plan_row(cell, seeds, sz, cache, hashes, cm, pending, w))
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
    w: int = 16,
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
        f"{cell.name:<{w}} {upr:>4} {cell.n * R:>6} {rounds:>6} {rounds * upr:>5} "
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
