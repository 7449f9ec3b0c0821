"""The tuned protocol of the replay sweep (issue #30): each cell's learning rate is chosen on
tuning seeds, the cell is then run at that lr on fresh seeds, and only the fresh seeds report
the saving, so the saving is not picked on the runs that report it.

Run it through the sweep's command (``tools/replay_sweep.py``)::

    python tools/replay_sweep.py --tune --cells paper --plan          # runs and time of both phases
    python tools/replay_sweep.py --tune --cells paper --jobs 2        # tuning phase
    python tools/replay_sweep.py --evaluate --cells paper --jobs 2    # evaluation phase
    python tools/replay_sweep.py --report                             # docs/results.md

``--tune`` runs every chosen cell, and on-policy (tuned the same way: it is the baseline), at
every ``--lr-grid`` lr (default 2.5e-5 5e-5 1e-4 2e-4: 4x below to 2x above the first sweep's
1e-4) on ``--tune-seeds`` (default 100 101). ``--evaluate`` runs each of those cells at its
chosen lr on ``--fresh-seeds`` (default 200-204; at least 5, none of them a tuning seed:
overlap is refused). The seeds of the first sweep (0-7) are in neither set: its lr was chosen
on on-policy seeds 0-2.

**The lr choice** (:func:`choose_lr`), per cell, from its tuning-seed runs only, comparing the
lrs by, in order:

1. the number of tuning seeds that reached the target (an lr that reached it on every seed
   beats one whose mean counts only its lucky seed);
2. the mean compute to target over those seeds, at the budget's mu (``--mu-budget``, fixed
   before the runs; within one cell uses ~ y x generated rollouts at every eval, so the
   ranking hardly depends on mu);
3. when no seed reached the target at any lr: the highest mean final held-out reward;
4. an exact tie: the lower lr (the smaller step is the safer one on new seeds).

A cell with a tuning run missing (any lr, any tuning seed) gets no lr and is not evaluated.

**Widening** (``--lr-extend K``, default 1): a cell whose choice is the grid's lowest lr
(highest) also runs at half that lr (twice it) on the tuning seeds, and is chosen again over
the wider grid, up to K times; the grid runs come first, then ``--tune`` runs the widenings
the cached runs call for. The rule and the seeds are the same, so the lr is still chosen on
the tuning seeds only. A cell still chosen at an end of its grid is named in the report: its
best lr may lie beyond, and its tuned compute is an upper bound. (On the first tuning seed of
the paper cells, most replay cells did best at the lowest lr, 2.5e-5: replay takes more
optimizer steps per rollout, which is the paper's reason to tune the lr per cell.)

**The saving** (:func:`fresh_savings`): at each mu (the median over the tuning runs, and the
paper's 5.3), the best tuned replay cell is the one with the lowest mean compute to target on
the tuning seeds at its chosen lr, among those that reached it on every tuning seed; its
saving vs tuned on-policy, ``1 - mean(replay) / mean(on-policy)`` of compute to target, is
computed on the fresh seeds only, paired by seed, with a bootstrap interval
(``replay_sweep_report.saving``). Compute is ``uses + mu x generated rollouts``
(``replay_sweep_report.compute_of``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.replay_sweep_grid import ONPOLICY, PAPER_MU, Cell, lr_name
from tools.replay_sweep_report import (
    QUIET_SHARE,
    bootstrap_mean,
    compute_of,
    fmt_ci,
    fmt_pct,
    hit,
    mu_runs,
    saving,
)
from tools.replay_sweep_theory import theory_check, theory_lines

DEFAULT_LR_GRID = (2.5e-5, 5e-5, 1e-4, 2e-4)
TUNE_SEEDS = (100, 101)
FRESH_SEEDS = (200, 201, 202, 203, 204)
MIN_FRESH = 5

Records = dict[Cell, dict[int, dict]]


def check_seeds(tune_seeds: list[int], fresh_seeds: list[int], min_fresh: int = MIN_FRESH) -> None:
    """Refuse tuning and fresh seeds that overlap, or too few fresh seeds (``ValueError``)."""
    both = sorted(set(tune_seeds) & set(fresh_seeds))
    if both:
        raise ValueError(
            f"--tune-seeds and --fresh-seeds share seed(s) {' '.join(map(str, both))}: the lr "
            "would be chosen on runs that report the saving; give disjoint seeds"
        )
    if not tune_seeds:
        raise ValueError("--tune-seeds is empty: the lr is chosen on them")
    if len(set(fresh_seeds)) < min_fresh:
        raise ValueError(
            f"--fresh-seeds has {len(set(fresh_seeds))} seed(s), the protocol needs >= "
            f"{min_fresh} (--pilot allows fewer)"
        )


# -- the lr choice ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LrPoint:
    """One lr of one cell on the tuning seeds: where each seed first reached the target."""

    lr: float
    hits: dict[int, list[float] | None]  # seed -> its curve point at the target (None: never)
    final: dict[int, float]  # seed -> final held-out reward (the trainer's eval)

    @property
    def reached(self) -> int:
        return sum(h is not None for h in self.hits.values())

    def per_seed(self, mu: float) -> dict[int, float]:
        return {s: compute_of(h, mu) if h else math.nan for s, h in self.hits.items()}

    def compute(self, mu: float) -> float:
        """Mean compute to target over the seeds that reached it (NaN: none did)."""
        got = [v for v in self.per_seed(mu).values() if not math.isnan(v)]
        return float(np.mean(got)) if got else math.nan

    def rank(self, mu: float) -> tuple:
        c = self.compute(mu)
        final = float(np.mean(list(self.final.values())))
        return (-self.reached, c if not math.isnan(c) else math.inf, -final, self.lr)


@dataclass(frozen=True)
class LrChoice:
    """A cell's tuning: its points in grid order, the runs missing, and the chosen lr (None
    when a tuning run is missing)."""

    cell: Cell  # at the sizing's lr (``Cell.base``)
    points: tuple[LrPoint, ...]
    missing: tuple[str, ...]
    lr: float | None
    grid: tuple[float, ...] = ()  # the lrs it was chosen over: the grid and its extensions

    @property
    def chosen(self) -> LrPoint | None:
        return next((p for p in self.points if p.lr == self.lr), None)

    @property
    def tuned(self) -> Cell | None:
        return self.cell.at(self.lr) if self.lr is not None else None


def choose_lr(
    records: Records,
    cell: Cell,
    lr_grid: list[float],
    tune_seeds: list[int],
    target: float,
    mu: float,
    extend: int = 0,
) -> LrChoice:
    """``cell``'s lr from its runs on ``tune_seeds`` only (the rule: module docstring); other
    seeds in ``records`` are not read. ``extend``: while the choice is the grid's lowest
    (highest) lr, up to this many times, widen the grid by half that lr (twice it) and
    choose again; a widening whose runs are missing leaves the cell without an lr."""
    grid = sorted(lr_grid)
    choice = _choose(records, cell.base, grid, tune_seeds, target, mu)
    for _ in range(extend):
        if choice.lr == grid[0]:
            grid = [grid[0] / 2, *grid]
        elif choice.lr == grid[-1]:
            grid = [*grid, grid[-1] * 2]
        else:
            break
        choice = _choose(records, cell.base, grid, tune_seeds, target, mu)
    return choice


def extended_grid(lr_grid: list[float], extend: int) -> list[float]:
    """Every lr a tuning may run: the grid, and up to ``extend`` halvings below and doublings
    above it."""
    lo, hi = min(lr_grid), max(lr_grid)
    more = [lo / 2**k for k in range(1, extend + 1)] + [hi * 2**k for k in range(1, extend + 1)]
    return sorted({*lr_grid, *more})


def _choose(
    records: Records,
    base: Cell,
    grid: list[float],
    tune_seeds: list[int],
    target: float,
    mu: float,
) -> LrChoice:
    points, missing = [], []
    for lr in grid:
        runs = records.get(base.at(lr), {})
        lost = [s for s in tune_seeds if s not in runs]
        if lost:
            missing.append(f"lr {lr_name(lr)} seed {' '.join(map(str, lost))}")
            continue
        hits = {s: hit(runs[s]["curve"], target) for s in tune_seeds}
        points.append(LrPoint(lr, hits, {s: runs[s]["final_reward"] for s in tune_seeds}))
    lr = None if missing or not points else min(points, key=lambda p: p.rank(mu)).lr
    return LrChoice(base, tuple(points), tuple(missing), lr, tuple(grid))


def to_run(choices: dict[Cell, LrChoice], tune_seeds: list[int], records: Records) -> list[Cell]:
    """The tuning runs the choices still miss (a widened grid's new lr, or a lost run)."""
    out = []
    for ch in choices.values():
        for lr in ch.grid:
            runs = records.get(ch.cell.at(lr), {})
            if any(s not in runs for s in tune_seeds):
                out.append(ch.cell.at(lr))
    return out


def choose_all(
    records: Records,
    lr_grid: list[float],
    tune_seeds: list[int],
    target: float,
    mu: float,
    cells: list[Cell] | None = None,
    extend: int = 0,
) -> dict[Cell, LrChoice]:
    """:func:`choose_lr` of ``cells`` (default: every cell with a tuned run in ``records``)."""
    bases = cells if cells is not None else sorted({c.base for c in records if c.lr is not None})
    return {c.base: choose_lr(records, c, lr_grid, tune_seeds, target, mu, extend) for c in bases}


def grid_edges(choices: dict[Cell, LrChoice]) -> list[str]:
    """The cells whose lr was chosen at an end of the grid they were chosen over (widened or
    not): there the best lr may lie beyond it, so the cell's tuned compute is an upper
    bound."""
    out = []
    for c, ch in choices.items():
        if ch.lr is not None and ch.lr in (min(ch.grid), max(ch.grid)):
            end = "lowest" if ch.lr == min(ch.grid) else "highest"
            out.append(f"{c.label()} at {lr_name(ch.lr)} ({end})")
    return out


def best_tuned(choices: dict[Cell, LrChoice], mu: float) -> LrChoice | None:
    """The replay cell with the lowest mean compute to target at its chosen lr on the tuning
    seeds, among those that reached it on every tuning seed."""
    ok = [
        ch
        for ch in choices.values()
        if ch.chosen and not ch.cell.onpolicy and ch.chosen.reached == len(ch.chosen.hits)
    ]
    return min(ok, key=lambda ch: (ch.chosen.compute(mu), ch.cell), default=None)


def evaluation_order(choices: list[LrChoice], mu: float) -> list[Cell]:
    """The tuned cells in the order ``--evaluate`` runs them, each on all its fresh seeds
    before the next: on-policy, then the replay cells from the best on the tuning seeds down
    (the lr choice's rank at ``mu``: seeds reached, then mean compute to target). The saving
    needs on-policy and the best cell on every fresh seed; an evaluation cut short (it spans
    sessions) then has those first. Cells without an lr are left out."""
    tuned = [ch for ch in choices if ch.tuned is not None]
    tuned.sort(key=lambda ch: (not ch.cell.onpolicy, ch.chosen.rank(mu), ch.cell.name))
    return [ch.tuned for ch in tuned]


# -- fresh seeds --------------------------------------------------------------------------------
def to_target(
    records: Records, cell: Cell, seeds: list[int], target: float, mu: float, tokens: bool = False
) -> dict[int, float]:
    """Per seed of ``seeds`` that ``cell`` ran: compute (or generated tokens) to target, NaN
    where it was not reached."""
    out = {}
    for s, rec in records.get(cell, {}).items():
        if s in seeds:
            h = hit(rec["curve"], target)
            out[s] = math.nan if h is None else (h[1] if tokens else compute_of(h, mu))
    return out


def fresh_savings(
    records: Records,
    choices: dict[Cell, LrChoice],
    fresh_seeds: list[int],
    target: float,
    mus: dict[str, float],
    n_boot: int = 10_000,
    best: dict[str, LrChoice | None] | None = None,
) -> list[dict[str, Any]]:
    """Per mu (``{"measured": mu, "paper": 5.3}``): the best tuned replay cell (picked on the
    tuning seeds, or given in ``best``) and its compute and token savings vs tuned on-policy
    on ``fresh_seeds``, paired by seed."""
    on = choices.get(ONPOLICY)
    out = []
    for tag, mu in mus.items():
        b = best[tag] if best is not None else best_tuned(choices, mu)
        if on is None or on.tuned is None or b is None:
            out.append({"mu": tag, "cell": None, "onpolicy": on.tuned if on else None})
            continue
        out.append(
            {
                "mu": tag,
                "cell": b.tuned,
                "onpolicy": on.tuned,
                "compute": saving(
                    to_target(records, on.tuned, fresh_seeds, target, mu),
                    to_target(records, b.tuned, fresh_seeds, target, mu),
                    n_boot,
                ),
                "tokens": saving(
                    to_target(records, on.tuned, fresh_seeds, target, mu, tokens=True),
                    to_target(records, b.tuned, fresh_seeds, target, mu, tokens=True),
                    n_boot,
                ),
            }
        )
    return out


# -- tables -------------------------------------------------------------------------------------
def lr_table_rows(
    choices: dict[Cell, LrChoice], lr_grid: list[float], mu: float
) -> list[list[str]]:
    """The compute-to-target vs lr table on the tuning seeds (the paper's Figure 4 as rows): a
    row per cell (mean compute to target over the seeds that reached it, ``(reached/seeds)``,
    the chosen lr in bold, ``n/a`` for a missing run), then the replay frontier: at each lr
    the replay cell with the lowest mean among those that reached the target on every seed."""
    rows = []
    for cell, ch in choices.items():
        by_lr = {p.lr: p for p in ch.points}
        cols = []
        for lr in lr_grid:
            p = by_lr.get(lr)
            # Blank: an lr outside the cell's grid (another cell's widening); n/a: missing.
            text = "" if lr not in ch.grid else "n/a" if p is None else _point(p, mu)
            cols.append(f"**{text}**" if p is not None and lr == ch.lr else text)
        chosen = lr_name(ch.lr) if ch.lr is not None else "incomplete"
        rows.append([cell.label(), *cols, chosen])
    best_at = frontier(choices, mu)
    front = [
        f"{best_at[lr][0]:,.0f} {best_at[lr][1].name}" if lr in best_at else "-" for lr in lr_grid
    ]
    b = best_tuned(choices, mu)
    rows.append(["replay frontier", *front, f"{b.cell.name} at {lr_name(b.lr)}" if b else "-"])
    return rows


def frontier(choices: dict[Cell, LrChoice], mu: float) -> dict[float, tuple[float, Cell]]:
    """The replay frontier: at each lr, the lowest mean compute to target among the replay
    cells that reached the target on every tuning seed there, with that cell."""
    best: dict[float, tuple[float, Cell]] = {}
    for c, ch in choices.items():
        for p in ch.points:
            if not c.onpolicy and p.reached == len(p.hits):
                best[p.lr] = min(best.get(p.lr, (math.inf, c)), (p.compute(mu), c))
    return best


def _point(p: LrPoint, mu: float) -> str:
    c = p.compute(mu)
    return f"{'-' if math.isnan(c) else format(c, ',.0f')} ({p.reached}/{len(p.hits)})"


def lr_table(choices: dict[Cell, LrChoice], lr_grid: list[float], mu: float) -> str:
    head = ["cell", *(f"lr {lr_name(lr)}" for lr in lr_grid), "chosen lr"]
    rows = [head, ["---"] * len(head), *lr_table_rows(choices, lr_grid, mu)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def fresh_table(
    records: Records,
    choices: dict[Cell, LrChoice],
    fresh_seeds: list[int],
    target: float,
    mus: dict[str, float],
    n_boot: int,
) -> str:
    """A row per tuned cell on the fresh seeds: reached, mean compute to target [interval] and
    saving vs tuned on-policy (paired by seed) at each mu."""
    on = choices.get(ONPOLICY)
    head = ["cell at its lr", "fresh seeds reached"]
    for mu in mus.values():
        head += [f"compute to target (mu = {mu:.2f})", f"saving vs on-policy (mu = {mu:.2f})"]
    rows = [head, ["---"] * len(head)]
    for ch in choices.values():
        if ch.tuned is None:
            continue
        got = to_target(records, ch.tuned, fresh_seeds, target, 1.0)
        reached = sum(not math.isnan(v) for v in got.values())
        row = [ch.tuned.label(), f"{reached}/{len(got)}"]
        for mu in mus.values():
            mine = to_target(records, ch.tuned, fresh_seeds, target, mu)
            row.append(fmt_ci(bootstrap_mean(list(mine.values()), n_boot), ",.0f"))
            if on is None or on.tuned is None or ch.cell.onpolicy:
                row.append("-")
                continue
            base = to_target(records, on.tuned, fresh_seeds, target, mu)
            row.append(fmt_pct(saving(base, mine, n_boot)))
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def plot_lr_curves(
    choices: dict[Cell, LrChoice], lr_grid: list[float], mus: dict[str, float], path: Path
) -> None:
    """The paper's Figure-4 view on the tuning seeds: compute to target against lr, a line per
    cell (points where every tuning seed reached the target; on-policy thick and black), and
    the replay frontier (the lowest replay cell at each lr) dashed, one panel per mu."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(mus), figsize=(6.5 * len(mus), 5), squeeze=False)
    for ax, (tag, mu) in zip(axes.flat, mus.items()):
        for cell, ch in choices.items():
            pts = [(p.lr, p.compute(mu)) for p in ch.points if p.reached == len(p.hits)]
            if not pts:
                continue
            x, y = zip(*pts)
            if cell.onpolicy:
                ax.plot(x, y, "k-o", lw=2.5, label=f"{cell.label()}", zorder=3)
                continue
            ax.plot(x, y, "-", marker=".", lw=0.8, alpha=0.6, label=cell.name)
        front = {lr: c for lr, (c, _) in frontier(choices, mu).items()}
        if front:
            fx = sorted(front)
            ax.plot(fx, [front[x] for x in fx], "r--", lw=2, label="replay frontier", zorder=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lr_grid, [lr_name(x) for x in lr_grid])
        ax.set_xlabel("learning rate")
        ax.set_ylabel("compute to target (learner passes over one rollout)")
        what = "measured" if tag == "measured" else "paper's"
        ax.set_title(f"{what} mu = {mu:.2f}", fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle("tuning seeds: mean compute to target over seeds, lrs where every seed reached it")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the report's section -----------------------------------------------------------------------
def _mu_basis(used: int, total: int) -> str:
    if used == total:
        return "all of them"
    return (
        f"those with >= {QUIET_SHARE:.0%} of a core; {total - used} that ran on a busier "
        "machine are left out, their wall-clock phases stretched unevenly"
    )


def _tuning_runs(records: Records, tune_seeds: list[int]) -> Records:
    tuned = {c: {s: r for s, r in runs.items() if s in tune_seeds} for c, runs in records.items()}
    return {c: runs for c, runs in tuned.items() if c.lr is not None}


def tuned_section(
    records: Records,
    *,
    lr_grid: list[float],
    tune_seeds: list[int],
    fresh_seeds: list[int],
    target: float,
    choice_mu: float,
    n_boot: int = 10_000,
    figure: Path | None = None,
    extend: int = 0,
) -> list[str]:
    """The report's lines on the tuned cells (those with an lr in their name): the
    compute-vs-lr tables, the fresh-seed table, the best tuned replay cell's saving at both
    mu and its sensitivity to the target. ``extend``: :func:`choose_lr`'s widenings."""
    mu, used, total = mu_runs(_tuning_runs(records, tune_seeds))
    mus = {"measured": mu, "paper": PAPER_MU}
    choices = choose_all(records, lr_grid, tune_seeds, target, choice_mu, extend=extend)
    columns = sorted(set(lr_grid).union(*(ch.grid for ch in choices.values())))
    other = sorted(
        {s for c, runs in records.items() if c.lr is not None for s in runs}
        - set(tune_seeds)
        - set(fresh_seeds)
    )
    lines = [
        "### Tuned lr per cell, fresh seeds (issue #30)",
        "",
        f"Each cell (and on-policy) ran at lr {', '.join(lr_name(x) for x in lr_grid)} on the "
        f"tuning seeds {', '.join(map(str, tune_seeds))}; its lr was chosen on those runs only "
        f"(most seeds reaching {target}, then lowest mean compute to target at mu = "
        f"{choice_mu}, then highest final reward, then the lower lr), and it ran at that lr on "
        f"the fresh seeds {', '.join(map(str, fresh_seeds))}. "
        + (
            f"A cell whose lr fell at an end of the grid also ran at half the lowest (twice "
            f"the highest) lr, up to {extend} time(s), and was chosen over that wider grid. "
            if extend
            else ""
        )
        + f"Measured mu: **{mu:.2f}** (median "
        f"over {used} of the {total} tuning runs: {_mu_basis(used, total)}). The best replay cell at each mu is picked on the tuning seeds; "
        "the savings are on the fresh seeds only.",
        "",
    ]
    incomplete = [f"{c.name} ({'; '.join(ch.missing)})" for c, ch in choices.items() if ch.missing]
    if incomplete:
        lines += [f"Tuning incomplete (no lr chosen): {', '.join(incomplete)}.", ""]
    if other:
        lines += [f"Left out: tuned-cell runs on seeds {', '.join(map(str, other))}.", ""]
    edges = grid_edges(choices)
    if edges:
        lines += [
            f"Chosen at an end of the lr grid (widened or not), so the best lr may lie beyond "
            f"it and the tuned compute is an upper bound for these cells: {'; '.join(edges)}.",
            "",
        ]
    for tag, m in mus.items():
        what = "measured" if tag == "measured" else "the paper's"
        lines += [
            f"Compute to target vs lr on the tuning seeds, at {what} mu = {m:.2f} (mean over "
            "the seeds that reached it, reached/seeds; bold: the chosen lr):",
            "",
            lr_table(choices, columns, m),
        ]
    if figure is not None and any(ch.points for ch in choices.values()):
        plot_lr_curves(choices, columns, mus, figure)
        lines += [f"![compute to target vs lr]({figure.name})", ""]
    lines += [
        "On the fresh seeds, at the chosen lr (mean [95% bootstrap interval]; savings paired "
        "by seed):",
        "",
        fresh_table(records, choices, fresh_seeds, target, mus, n_boot),
    ]
    best = {tag: best_tuned(choices, m) for tag, m in mus.items()}
    lines += _saving_lines(fresh_savings(records, choices, fresh_seeds, target, mus, n_boot), mus)
    lines += ["", _sensitivity(records, choices, fresh_seeds, target, mus, best, n_boot)]
    tuned = [ch.tuned for ch in choices.values() if ch.tuned is not None]
    fresh_ran = any(s in records.get(c, {}) for c in tuned for s in fresh_seeds)
    seeds, label = (fresh_seeds, "fresh seeds") if fresh_ran else (tune_seeds, "tuning seeds")
    if tuned:
        check = theory_check(records, tuned, list(seeds), target, mu)
        lines += [*theory_lines(check, mu, label), ""]
    return lines


def _saving_lines(found: list[dict[str, Any]], mus: dict[str, float]) -> list[str]:
    lines = []
    for b in found:
        tag = f"mu = {mus[b['mu']]:.2f}" + (" (measured)" if b["mu"] == "measured" else "")
        if b["onpolicy"] is None:
            lines.append(f"* {tag}: on-policy has no tuned lr (run --tune): no saving to state.")
            continue
        if b["cell"] is None:
            lines.append(f"* {tag}: no tuned replay cell reached the target on every tuning seed.")
            continue
        lines.append(
            f"* {tag}: best tuned replay cell **{b['cell'].name}** (vs {b['onpolicy'].name}); "
            f"compute to target on the fresh seeds: saving {fmt_pct(b['compute'])}; "
            f"generated tokens: saving {fmt_pct(b['tokens'])}."
        )
    return lines


def _sensitivity(
    records: Records,
    choices: dict[Cell, LrChoice],
    fresh_seeds: list[int],
    target: float,
    mus: dict[str, float],
    best: dict[str, LrChoice | None],
    n_boot: int,
) -> str:
    """The fresh-seed saving at targets around ``target``, with the lrs and the best cells
    kept as chosen at ``target``."""
    rows = [
        "| target (lrs and cells as chosen at "
        f"{target}) | best at measured mu: saving | best at mu = {PAPER_MU}: saving |",
        "|---|---|---|",
    ]
    for t in (target - 0.04, target - 0.02, target, target + 0.02):
        cols = []
        for b in fresh_savings(records, choices, fresh_seeds, t, mus, n_boot, best=best):
            cols.append(f"{b['cell'].name}: {fmt_pct(b['compute'])}" if b["cell"] else "none")
        rows.append(f"| {t:.2f} | " + " | ".join(cols) + " |")
    return "\n".join(rows) + "\n"
