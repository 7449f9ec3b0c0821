"""Issue #30 item 5, the theory check: what the paper's trade-off needs, measured on the runs.

Arnal et al. (2026) model the buffer's design as a trade-off between staleness-induced variance,
sample diversity and the cost of generation, and predict that on-policy is optimal as the
generation/training cost ratio ``mu`` goes to 0 while a buffer wins when generation is dear.
Their closed form was not reachable from this machine (only the abstract and section summaries
were), so the check uses what follows from the compute model the sweep shares with the paper,
``compute = uses + mu x generated`` (``replay_sweep_report.compute_of``), and the measured
proxies of the terms it trades:

* **break-even mu**: a cell needing ``U`` learner passes and ``G`` generated rollouts to reach
  the target is cheaper than on-policy's ``(U0, G0)`` exactly where ``U + mu G < U0 + mu G0``;
  with more passes but fewer rollouts (the usual replay cell) that is ``mu > (U - U0) / (G0 -
  G)``. The paper's prediction "on-policy optimal as mu -> 0" is ``U >= U0`` for every replay
  cell; "a buffer wins at the paper's mu" is a break-even below 5.3.
* **staleness** (mean and variance of the policy versions between a row's generation and its
  use, over every drawn row) and the **sample-iterate coupling** proxy (mean approx. KL between
  the learner and the behaviour policy on the drawn rows: staleness drift plus the learner
  having already trained on those rows), from ``replay_sweep.drift_proxies``;
* whether staleness costs learner passes, as the trade-off says: the rank correlation, over
  the replay cells, of staleness variance with the passes to target relative to on-policy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tools.replay_sweep_grid import PAPER_MU, Cell
from tools.replay_sweep_report import hit

Records = dict[Cell, dict[int, dict]]
PROXIES = ("staleness_mean", "staleness_var", "approx_kl_mean")


def break_even(u: float, g: float, u0: float, g0: float) -> tuple[str, float]:
    """Where ``(u, g)`` (passes, rollouts to target) is cheaper than ``(u0, g0)``:
    ``("always"|"never", nan)``, ``("above", mu*)`` or ``("below", mu*)``."""
    du, dg = u - u0, g0 - g  # extra passes; rollouts saved
    if du <= 0 and dg >= 0:
        return ("never", math.nan) if du == 0 and dg == 0 else ("always", math.nan)
    if du >= 0 and dg <= 0:
        return "never", math.nan
    mu = du / dg
    return ("above", mu) if dg > 0 else ("below", mu)


def fmt_break_even(kind: str, mu: float) -> str:
    return {"always": "every mu", "never": "no mu"}.get(
        kind
    ) or f"mu {'>' if kind == 'above' else '<'} {mu:.2f}"


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation (average ranks for ties); NaN with fewer than 3 pairs or no spread."""
    if len(x) < 3:
        return math.nan

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = np.argsort(a, kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for val in np.unique(a):  # ties share their mean rank
            r[a == val] = r[a == val].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def cell_point(runs: dict[int, dict], seeds: list[int], target: float) -> dict[str, Any]:
    """Over ``seeds``: mean passes and rollouts to target (seeds that reached it), how many
    reached, and the mean drift proxies (every run)."""
    got = [runs[s] for s in seeds if s in runs]
    hits = [h for h in (hit(r["curve"], target) for r in got) if h is not None]
    out: dict[str, Any] = {
        "runs": len(got),
        "reached": len(hits),
        "uses": float(np.mean([h[3] for h in hits])) if hits else math.nan,
        "rollouts": float(np.mean([h[2] for h in hits])) if hits else math.nan,
    }
    for key in PROXIES:
        vals = [r[key] for r in got if isinstance(r.get(key), float) and not math.isnan(r[key])]
        out[key] = float(np.mean(vals)) if vals else math.nan
    return out


def theory_check(
    records: Records, tuned: list[Cell], seeds: list[int], target: float, mu: float
) -> dict[str, Any]:
    """The check over the ``tuned`` cells (each at its chosen lr; on-policy among them) on
    ``seeds``: a point per cell with its break-even mu vs on-policy, the staleness/passes
    rank correlation over the replay cells, and the cell the compute model picks at ``mu``
    and at the paper's 5.3."""
    points = {c: cell_point(records.get(c, {}), seeds, target) for c in tuned}
    on = next((c for c in tuned if c.onpolicy), None)
    o = points.get(on) if on is not None else None
    for c, p in points.items():
        ok = o is not None and not c.onpolicy and not math.isnan(p["uses"] + o["uses"])
        p["break_even"] = (
            break_even(p["uses"], p["rollouts"], o["uses"], o["rollouts"]) if ok else None
        )
    replay = [c for c in tuned if not c.onpolicy and not math.isnan(points[c]["uses"])]
    corr = math.nan
    if o is not None and not math.isnan(o["uses"]):
        pairs = [(points[c]["staleness_var"], points[c]["uses"] / o["uses"]) for c in replay]
        pairs = [(a, b) for a, b in pairs if not math.isnan(a)]
        corr = spearman([a for a, _ in pairs], [b for _, b in pairs])
    reached = [c for c in tuned if not math.isnan(points[c]["uses"])]

    def pick(m: float) -> Cell | None:
        return min(
            reached, key=lambda c: (points[c]["uses"] + m * points[c]["rollouts"], c), default=None
        )

    return {
        "points": points,
        "onpolicy": on,
        "staleness_vs_passes": corr,
        "best": {"measured": pick(mu), "paper": pick(PAPER_MU)},
        # None: nothing to compare yet (no replay cell, or on-policy, reached the target)
        "onpolicy_least_passes": (
            all(points[c]["uses"] >= o["uses"] for c in replay)
            if replay and o is not None and not math.isnan(o["uses"])
            else None
        ),
    }


def theory_lines(check: dict[str, Any], mu: float, seeds_label: str) -> list[str]:
    """The report's subsection: a table of the cells and the reading."""
    pts, on = check["points"], check["onpolicy"]
    lines = [
        "#### Theory check (issue #30 item 5)",
        "",
        f"On the {seeds_label}, each cell at its chosen lr: mean learner passes (U) and generated "
        "rollouts (G) to the target over the seeds that reached it; the mu above (or below) "
        "which the cell is cheaper than tuned on-policy, from `U + mu G < U0 + mu G0`; the "
        "staleness of the drawn rows (policy versions; mean and variance) and the mean approx. "
        "KL between learner and behaviour policy on them (the sample-iterate coupling proxy). "
        "The paper's closed form was not reachable here; this is its compute model and the "
        "measurable terms of its trade-off (`tools/replay_sweep_theory.py`).",
        "",
        "| cell | reached | U | G | cheaper than on-policy at | staleness mean | "
        "staleness var | approx KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # A cell not run on these seeds yet (an evaluation under way) gets no row: it is named.
    unrun = [c.label() for c, p in pts.items() if p["runs"] == 0]
    for c, p in ((c, p) for c, p in pts.items() if p["runs"]):
        be = (
            "(baseline)"
            if c.onpolicy
            else (fmt_break_even(*p["break_even"]) if p["break_even"] else "-")
        )
        lines.append(
            f"| {c.label()} | {p['reached']}/{p['runs']} | {p['uses']:,.0f} | {p['rollouts']:,.0f} "
            f"| {be} | {p['staleness_mean']:.2f} | {p['staleness_var']:.2f} | "
            f"{p['approx_kl_mean']:.2g} |"
        )
    best = check["best"]
    name = {k: (c.name if c else "none") for k, c in best.items()}
    least = {
        True: "**yes**",
        False: "**no**",
        None: "no comparison yet (on-policy and a tuned replay cell must reach the target)",
    }
    corr = check["staleness_vs_passes"]
    if unrun:
        lines += ["", f"Not run on the {seeds_label} yet: {', '.join(unrun)}."]
    lines += [
        "",
        f"* On-policy needs the fewest learner passes of all cells (the paper's 'on-policy is "
        f"optimal as mu -> 0'): {least[check['onpolicy_least_passes']]}.",
        f"* The compute model picks **{name['measured']}** at the measured mu = {mu:.2f} and "
        f"**{name['paper']}** at mu = {PAPER_MU}"
        + (f" (on-policy is {on.name})." if on is not None else "."),
        "* Staleness variance vs passes to target relative to on-policy, rank correlation over "
        "the replay cells: "
        + ("n/a (needs 3 replay cells with a spread)" if math.isnan(corr) else f"{corr:.2f}")
        + " (the trade-off predicts > 0).",
    ]
    return lines
