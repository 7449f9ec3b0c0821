"""Plots of a run's metrics: reward, entropy and staleness against step and generated tokens.

    rolloutstore-train plot RUN_DIR          # writes RUN_DIR/plots/*.png

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per event, ``kind`` = train,
generate or eval). Needs matplotlib (the ``plot`` extra; in ``dev`` too).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(run_dir: str | Path) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            by_kind.setdefault(rec["kind"], []).append(rec)
    return by_kind


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'rolloutstore[plot]'") from exc
    m = load_metrics(run_dir)
    train, evals = m.get("train", []), m.get("eval", [])
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    series = {
        "reward": [
            ("batch reward (replayed)", train, "reward"),
            ("held-out reward", evals, "reward"),
        ],
        "entropy": [("entropy", train, "entropy")],
        "staleness": [("mean staleness of the batch", train, "staleness")],
    }
    paths = []
    for name, lines in series.items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, xkey, xlabel in (
            (axes[0], "step", "learner step"),
            (axes[1], "generated_tokens", "generated tokens"),
        ):
            for label, recs, key in lines:
                pts = [(r[xkey], r[key]) for r in recs if key in r and xkey in r]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o" if recs is evals else None, ms=3, label=label)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{Path(run_dir).name}: {name}")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
