"""Plots of a run's metrics: reward, entropy and staleness against step and generated tokens.

    rolloutstore-train plot RUN_DIR          # writes RUN_DIR/plots/*.png

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per event, ``kind`` = train,
generate, eval or control). ``reward.png`` draws the replayed batch's reward beside the
policy's own (each generation round's mean reward, from the ``generate`` records) and the
held-out reward. Runs with the replay-ratio controller (``[replay.control]``) also
get ``control.png``: updates per round and fresh_fraction, and the inputs of each decision,
against step. Needs matplotlib (the ``plot`` extra; in ``dev`` too).
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


def generation_rounds(m: dict[str, list[dict]]) -> list[dict]:
    """The ``generate`` records (one per round: its mean ``reward``, the policy's own), each
    with ``generated_tokens``, the tokens generated up to and including it."""
    out, total = [], 0
    for r in m.get("generate", []):
        total += r.get("tokens", 0)
        out.append({**r, "generated_tokens": total})
    return out


def reward_lines(m: dict[str, list[dict]]) -> list[tuple[str, list[dict], str]]:
    """reward.png's lines: (label, records, key). The replayed batch's reward can stay high
    while the policy itself scores near 0, so the policy's own reward (each generation
    round's mean) is drawn beside it, and the held-out reward."""
    return [
        ("batch reward (replayed)", m.get("train", []), "reward"),
        ("policy's own reward (each generation round)", generation_rounds(m), "reward"),
        ("held-out reward", m.get("eval", []), "reward"),
    ]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'rolloutstore[plot]'") from exc
    m = load_metrics(run_dir)
    train = m.get("train", [])
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    series = {
        "reward": reward_lines(m),
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
                pts = [
                    (r[xkey], r[key])
                    for r in recs
                    if r.get(key) is not None and r.get(xkey) is not None
                ]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker=None if recs is train else "o", ms=3, label=label)
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
    if m.get("control"):
        paths.append(_plot_control(plt, m["control"], out_dir / "control.png", Path(run_dir).name))
    return paths


def _plot_control(plt, recs: list[dict], path: Path, title: str) -> Path:
    """Controller decisions vs step: the knobs on top, the signals they were decided from below."""
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    steps = [r["step"] for r in recs]
    ax = axes[0]
    ax.step(
        steps, [r["updates_per_round"] for r in recs], where="post", label="updates per round y"
    )
    backs = [r for r in recs if r.get("verdict") == "back_off"]
    ax.plot(
        [r["step"] for r in backs],
        [r["updates_per_round"] for r in backs],
        "v",
        ms=4,
        color="C3",
        label="back off",
    )
    ax.set_ylabel("y")
    ax2 = ax.twinx()
    ax2.step(
        steps, [r["fresh_fraction"] for r in recs], where="post", color="C1", label="fresh_fraction"
    )
    ax2.set_ylabel("fresh_fraction")
    ax2.set_ylim(-0.05, 1.05)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper right")
    for ax, keys in (
        (axes[1], ("ess_frac", "clip_frac")),
        (axes[2], ("approx_kl", "reward_trend")),
    ):
        for key in keys:
            pts = [(r["step"], r[f"in_{key}"]) for r in recs if r.get(f"in_{key}") is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, lw=1, label=key)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].grid(alpha=0.3)
    axes[2].set_xlabel("learner step")
    fig.suptitle(f"{title}: replay-ratio controller (inputs: means over the previous round)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
