"""The analysis of the replay sweep (``tools/replay_sweep.py``): from the cached runs, each
run's compute and generated tokens to the target accuracy, the bootstrap intervals over seeds,
the best replay cell's saving vs on-policy paired by seed and its sensitivity to the target,
the table, the figures and the Markdown block of ``docs/results.md``. The cells run at the
sizing's lr make the tables here; the cells with a tuned lr (``-lrX``) make the section of
``tools/replay_sweep_tune.py``, which this block includes after them.

Run it through the sweep's command (the report's command line is the sweep's)::

    python tools/replay_sweep.py --report          # writes docs/results.md and its figures
"""

from __future__ import annotations

import math
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from tools.replay_common import write_report as _write_report
from tools.replay_sweep_grid import ONPOLICY, PAPER, PAPER_MU, Cache, Cell, Sizing, lr_name

SWEEP_BEGIN, SWEEP_END = "<!-- sweep:begin -->", "<!-- sweep:end -->"


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
    within the run). The start (a point with no generation and no learner pass) counts on its
    own reward only: smoothed, it would borrow the first trained eval's and credit a run with
    the target at zero compute."""
    sm = smoothed([p[4] for p in curve])
    for p, r in zip(curve, sm):
        if (p[4] if p[2] == 0 and p[3] == 0 else r) >= target:
            return p
    return None


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


QUIET_SHARE = 0.8  # a run with at least this share of a core (CPU / wall seconds) ran unstarved


def mu_runs(records: dict[Cell, dict[int, dict]]) -> tuple[float, int, int]:
    """The measured mu, the median over the runs that had a core (``cpu_s >= QUIET_SHARE x
    wall_s``: a starved run's wall-clock phases stretch unevenly with whatever else ran), or
    over every run when fewer than 3 had one; with the number of runs used and of all runs."""
    runs = [r for rr in records.values() for r in rr.values() if math.isfinite(r["mu"])]
    quiet = [r for r in runs if r.get("cpu_s", 0.0) >= QUIET_SHARE * r["wall_s"]]
    use = quiet if len(quiet) >= 3 else runs
    return (float(np.median([r["mu"] for r in use])) if use else math.nan), len(use), len(runs)


def measured_mu(records: dict[Cell, dict[int, dict]]) -> float:
    return mu_runs(records)[0]


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


def plot_panels(summ: dict[Cell, dict[str, Any]], path: Path, target: float, subject: str) -> None:
    """One panel per metric: ppo cells against y (a line per N), the y = 8 loss variants
    beside them, on-policy as a dashed line; error bars are the 95% intervals. ``subject``:
    the task and model, for the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (key, label, _) in zip(axes.flat, PANELS):
        _panel(ax, summ, key)
        # Limits from the cells, not the data: a panel whose runs never reached the target
        # holds no finite point, and a log axis cannot guess limits from none.
        ax.set_xlim(0.7, 1.4 * max(c.y for c in summ))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replay ratio y")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{subject}: mean and 95% bootstrap interval over seeds "
                 f"(target {target}; dashed: on-policy)")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax: Any, summ: dict[Cell, dict[str, Any]], key: str) -> None:
    """``key``'s panel: a line per N of the ppo cells, a marker per loss variant (nudged
    right of its y so the error bars do not overlap), the on-policy band."""
    variants = [c for c in summ if not c.plain]
    for i, n in enumerate(sorted({c.n for c in summ if c.plain})):
        cells = sorted((c for c in summ if c.plain and c.n == n), key=lambda c: c.y)
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


def named_arms(
    records: dict[Cell, dict[int, dict]], protocol_seeds: set[int]
) -> dict[Cell, dict[int, dict]]:
    """The runs at a named lr on seeds outside the tuned protocol's (``--tune-seeds`` and
    ``--fresh-seeds``): arms of a comparison, e.g. on-policy vs the best tuned cell on a real
    model, each at the lr the tuned sweep gave it (issue #30 item 4). A cell run at two lrs
    there is refused (which would be its arm?)."""
    arms: dict[Cell, dict[int, dict]] = {}
    for c, runs in sorted(records.items()):
        runs = {s: r for s, r in runs.items() if s not in protocol_seeds}
        if c.lr is None or not runs:
            continue
        if any(a.base == c.base for a in arms):
            raise SystemExit(
                f"error: {c.base.name} ran at two lrs on seeds outside the tuned protocol's; "
                "report one comparison at a time (--cache, or --seeds of the protocol)"
            )
        arms[c] = runs
    return arms


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
    tuned: list[str] = (),
    arms: dict[Cell, dict[int, dict]] | None = None,
) -> str:
    """Write the sweep's block of ``out`` (tables, savings, figures; then the ``tuned``
    section's lines) and return it. ``arms`` (:func:`named_arms`): cells at their own lr,
    reported as the tables report the cells at the sizing's lr (there are none then): keyed
    by that cell, so that on-policy is the baseline."""
    records = cache.records(hashes)
    if not records:
        raise SystemExit(
            "no cached runs match the current configuration: nothing to report (pass the "
            "sizing options the sweep ran with, e.g. --budget-rounds)"
        )
    # The cells at the sizing's lr; the tuned cells are the tuned section's.
    plain = {c: runs for c, runs in records.items() if c.lr is None}
    picked_here = True
    if not plain and arms:
        plain, picked_here = {c.base: runs for c, runs in arms.items()}, False
    mu = measured_mu(plain or records)
    shown = records if picked_here else plain  # the arms: the runs of the comparison only
    lines = _intro(cache, shown, sz, target=target, mu=mu, command=command, pilot=pilot)
    if not picked_here:
        lines += [
            "Arms, each at its own lr: "
            + "; ".join(f"{c.base.label()} at lr {lr_name(c.lr)}" for c in arms)
            + ". The tables name each arm without its lr.",
            "",
        ]
    if plain:
        lines += _untuned(
            plain, sz, out, target=target, mu=mu, n_boot=n_boot, pilot=pilot,
            picked_here=picked_here, subject=_subject(cache),
        )  # fmt: skip
    block = "\n".join(lines + list(tuned))
    _write_block(out, block)
    return block


def _untuned(
    records: dict[Cell, dict[int, dict]],
    sz: Sizing,
    out: Path,
    *,
    target: float,
    mu: float,
    n_boot: int,
    pilot: bool,
    picked_here: bool = True,
    subject: str = "carry_add, tiny model",
) -> list[str]:
    """The tables, savings and figures of the cells run at the sizing's lr (or of the named
    arms: ``picked_here`` False, the replay arm was chosen elsewhere)."""
    summ = summarise_cells(records, target, mu, n_boot)
    stem = out.stem + ("_pilot" if pilot else "_sweep")
    panels_png = out.with_name(f"{stem}_panels.png")
    curves_png = out.with_name(f"{stem}_curves.png")
    lines = [
        "Mean [95% bootstrap interval over seeds]; to-target columns average the seeds that "
        "reached the target (`reached`). Compute unit: one learner pass over one rollout.",
        "",
        table(summ, sz),
        *_saving_lines(summ, target, mu, n_boot),
        "",
        sensitivity(records, target, mu, n_boot),
        "",
        "(The best cell is picked on the same runs, so its saving is optimistic; seeds 5+ "
        "of phase 2 are the check.)"
        if picked_here
        else "(The replay arm was chosen before these runs, so its saving is not picked on them.)",
        "",
        f"![panels]({panels_png.name})",
        "",
        f"![reward vs compute]({curves_png.name})",
        "",
    ]
    plot_panels(summ, panels_png, target, subject)
    plot_curves(records, _curve_cells(summ), curves_png, mu, target)
    return lines


def _intro(
    cache: Cache,
    records: dict[Cell, dict[int, dict]],
    sz: Sizing,
    *,
    target: float,
    mu: float,
    command: str,
    pilot: bool,
) -> list[str]:
    """The report's opening paragraphs: the commands that ran, the runs' sizes and times, the
    target and budget, the measured mu, and the warm start every run began from."""
    runs = sum(len(r) for r in records.values())
    wall = sum(s.get("seconds", 0.0) for s in cache.sessions)
    run_s = [r["wall_s"] for rr in records.values() for r in rr.values()]
    # mu's range over the runs its median is over: those at the sizing's lr, if any.
    plain = {c: rr for c, rr in records.items() if c.lr is None} or records
    all_mu = [r["mu"] for rr in plain.values() for r in rr.values()]
    lines = [
        "Runs: "
        + "; ".join(
            f"`{' '.join(['python tools/replay_sweep.py', *(_quote(a) for a in se['argv'])])}` "
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
        f"over the runs that had >= {QUIET_SHARE:.0%} of a core, or all when fewer than 3 "
        f"did): **{mu:.2f}** (runs' range {min(all_mu):.2f}-{max(all_mu):.2f}).",
        "",
    ]
    w = cache.warm
    if w:
        spec, built = w.get("spec", {}), "weights" in w and "machine" in w
        start = (
            f"the base model of the config ({spec.get('model', {}).get('path')})"
            if spec.get("start") == "base"
            else f"the supervised warm start of {sz.warm_steps} steps"
        )
        lines += [
            f"Start (all runs): {start}, held-out "
            f"pass@1 {w['pass1']:.3f}, pass@4 {w['pass4']:.3f}, entropy "
            f"{w['heldout_entropy']:.3f} nats/token, {w['heldout_tokens']:.1f} tokens per "
            "completion"
            + (f" (weights {w['weights']}, scored on {_machine(w['machine'])})" if built else "")
            + ".",
            "",
        ]
    machines = Counter(
        _machine(r["machine"]) if "machine" in r else "not recorded"
        for rr in records.values()
        for r in rr.values()
    )
    lines += [
        "Machines (runs on two are replicates from the one start, their rounding differs as a "
        "seed does): " + "; ".join(f"{k}: {v} runs" for k, v in sorted(machines.items())) + ".",
        "",
    ]
    return lines


def _machine(m: dict[str, Any]) -> str:
    """A run's machine (``replay_sweep_grid.machine``) in words."""
    return f"{m.get('cpu')} ({m.get('capability')}, {m.get('cores')} cores, torch {m.get('torch')})"


def _subject(cache: Cache) -> str:
    """The figures' task and model: the tiny model's ``carry_add``, or the config's own."""
    spec = (cache.warm or {}).get("spec", {})
    if spec.get("start") != "base":
        return "carry_add, tiny model"
    return f"{spec.get('task', {}).get('name')}, {Path(spec.get('model', {}).get('path', '?')).parent.name}"


def _quote(arg: str) -> str:
    """A recorded argument as the report quotes it: paths inside the checkout relative to it
    (the sweep may have run from another worktree or with absolute paths)."""
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return shlex.quote(arg[len(root) :] if arg.startswith(root) else arg)


def _saving_lines(
    summ: dict[Cell, dict[str, Any]], target: float, mu: float, n_boot: int
) -> list[str]:
    """One bullet per mu: the best replay cell and its compute and token savings."""
    lines = []
    for b in savings(summ, n_boot):
        tag = f"mu = {mu:.2f} (measured)" if b["mu"] == "measured" else f"mu = {PAPER_MU}"
        if b["cell"] is None:
            lines.append(f"* {tag}: no replay cell reached the target on every seed.")
            continue
        lines.append(
            f"* {tag}: best replay cell **{b['cell'].name}**; compute to {target} vs "
            f"on-policy: saving {fmt_pct(b['compute'])}; generated tokens: saving "
            f"{fmt_pct(b['tokens'])}."
        )
    return lines


def _curve_cells(summ: dict[Cell, dict[str, Any]]) -> list[Cell]:
    """The reward-vs-compute figure's cells: on-policy, the best replay cells, and the y axis
    at N = 4x (the losses' buffer); the rest would crowd it."""
    shown = [ONPOLICY] + best_cells(summ, "compute_to_target@measured", 3)
    shown += [c for c in summ if c.n == 4 and c.plain]
    return list(dict.fromkeys(c for c in shown if c in summ))


def _write_block(out: Path, block: str) -> None:
    """Put ``block`` between the sweep's markers of ``out``, keeping the hand-written reading
    around it; a report from before the markers stays below, to edit by hand."""
    head = (
        "# Replay ratio x buffer size: compute to reach a target accuracy\n\n"
        f"See the docstring of `tools/replay_sweep.py` ([paper]({PAPER})).\n\n"
    )
    text = out.read_text() if out.exists() else ""
    tail = "\n## Reading\n\n(to write from the tables above)\n"
    if text and SWEEP_BEGIN not in text:
        tail += "\n---\n\n" + text
    _write_report(out, block, head, tail, markers=(SWEEP_BEGIN, SWEEP_END))
