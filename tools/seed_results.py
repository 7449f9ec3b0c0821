"""Run one config over several seeds and report what it learned: eval curve, entropy, mu.

    python tools/seed_results.py examples/smollm2_arith.toml --seeds 0 1 2 --out runs/smollm2_seeds
    python tools/seed_results.py examples/smollm2_arith.toml --seeds 0 1 2 --parallel 3 \
        --set 'model.path="/models/smollm2"'           # on a GPU: seeds side by side
    python tools/seed_results.py --report runs/smollm2_seeds   # the report of finished runs

Each seed trains in its own run folder (``OUT/seed-S``, ``--set run.seed=S``) with
``rolloutstore-train train`` (``python -m trainer train``), ``--parallel`` of them at once.
The report (``OUT/results.md``, printed too) has, from each run's ``metrics.jsonl``:

- the held-out eval reward per eval step, per seed and as mean +- standard deviation over seeds
  (and each eval's own standard error over prompts when the run records it);
- the policy entropy of the first and last learner steps;
- generation seconds per rollout, learner seconds per rollout use and their ratio mu (the
  paper's cost of generating a rollout in learner-step units), from the runs' own timings;
- the machine (device, load average at the end).

``OUT/results.png`` draws each seed's eval curve and their mean. Needs matplotlib for the plot
(the ``plot`` extra; in ``dev``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _records(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    path = run / "metrics.jsonl"
    if not path.exists():
        return out
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out.setdefault(rec["kind"], []).append(rec)
    return out


def _stderr(rec: dict) -> float | None:
    for key in ("reward_stderr", "stderr", "reward_se"):
        if rec.get(key) is not None:
            return float(rec[key])
    return None


def _evals(recs: dict[str, list[dict]]) -> dict[int, dict]:
    """The last eval record of each step (a resumed run may repeat one)."""
    return {int(r["step"]): r for r in recs.get("eval", [])}


def _cost(recs: dict[str, list[dict]]) -> dict[str, float]:
    gen = recs.get("generate", [])
    train = recs.get("train", [])
    gen_s = sum(r.get("seconds", 0.0) for r in gen)
    rollouts = sum(r.get("rollouts", 0) for r in gen)
    train_s = sum(r.get("seconds", 0.0) for r in train)
    uses = sum(r.get("sequences", 0.0) for r in train)
    out = {"gen_seconds": gen_s, "rollouts": rollouts, "train_seconds": train_s, "uses": uses}
    if rollouts and uses and train_s:
        out["mu"] = (gen_s / rollouts) / (train_s / uses)
    return out


def report(out: Path) -> str:
    runs = sorted(p for p in out.glob("seed-*") if (p / "metrics.jsonl").exists())
    if not runs:
        raise SystemExit(f"no finished runs (seed-*/metrics.jsonl) under {out}")
    recs = {int(p.name.split("-", 1)[1]): _records(p) for p in runs}
    evals = {s: _evals(r) for s, r in recs.items()}
    steps = sorted(set().union(*(e.keys() for e in evals.values())))
    seeds = sorted(recs)
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; held-out eval reward per seed "
        "(+- its standard error over prompts, where recorded) and mean +- sd over seeds:",
        "",
        "| step | " + " | ".join(f"seed {s}" for s in seeds) + " | mean +- sd |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for step in steps:
        cells, vals = [], []
        for s in seeds:
            rec = evals[s].get(step)
            if rec is None:
                cells.append("-")
                continue
            vals.append(float(rec["reward"]))
            se = _stderr(rec)
            cells.append(f"{rec['reward']:.3f}" + (f" +- {se:.3f}" if se is not None else ""))
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        mean = f"{statistics.mean(vals):.3f} +- {sd:.3f}" if vals else "-"
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {mean} |")
    lines += ["", "| seed | entropy first -> last step | gen s / rollout | learner s / use | mu |"]
    lines.append("|---|---|---|---|---|")
    for s in seeds:
        train = recs[s].get("train", [])
        ent = [r["entropy"] for r in train if r.get("entropy") is not None]
        c = _cost(recs[s])
        per_roll = c["gen_seconds"] / c["rollouts"] if c["rollouts"] else float("nan")
        per_use = c["train_seconds"] / c["uses"] if c["uses"] else float("nan")
        ent_txt = f"{ent[0]:.3f} -> {ent[-1]:.3f}" if ent else "-"
        mu = f"{c['mu']:.2f}" if "mu" in c else "-"
        lines.append(f"| {s} | {ent_txt} | {per_roll:.3f} | {per_use:.3f} | {mu} |")
    machine = out / "machine.txt"
    if machine.exists():
        lines += ["", machine.read_text().strip()]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    _plot(out, seeds, evals)
    return text


def _plot(out: Path, seeds: list[int], evals: dict[int, dict[int, dict]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'rolloutstore[plot]')")
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    by_step: dict[int, list[float]] = {}
    for s in seeds:
        pts = sorted((k, float(r["reward"])) for k, r in evals[s].items())
        for k, v in pts:
            by_step.setdefault(k, []).append(v)
        ax.plot(*zip(*pts), marker="o", ms=3, alpha=0.5, label=f"seed {s}")
    steps = sorted(by_step)
    ax.plot(steps, [statistics.mean(by_step[k]) for k in steps], color="k", lw=2, label="mean")
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out eval reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)


def _machine() -> str:
    try:
        import torch

        device = (
            torch.cuda.get_device_name(0)
            if torch.cuda.is_available()
            else f"CPU, {os.cpu_count()} cores"
        )
    except ImportError:
        device = f"CPU, {os.cpu_count()} cores"
    return f"Machine: {device}; load average at the end {os.getloadavg()[0]:.1f}."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", help="run config (TOML)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("runs/seed_results"))
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--set", action="append", default=[], help="passed to every run")
    ap.add_argument("--report", type=Path, help="only write the report of runs under this folder")
    args = ap.parse_args(argv)
    if args.report is not None:
        print(report(args.report))
        return 0
    if not args.config:
        ap.error("a config is needed (or --report OUT)")
    args.out.mkdir(parents=True, exist_ok=True)
    pending = list(args.seeds)
    running: list[tuple[int, subprocess.Popen, float]] = []
    failed = []
    t0 = time.time()
    while pending or running:
        while pending and len(running) < args.parallel:
            seed = pending.pop(0)
            run = args.out / f"seed-{seed}"
            cmd = [sys.executable, "-m", "trainer", "train", args.config]
            cmd += ["--set", f"run.seed={seed}", "--set", f'run.dir="{run}"']
            for s in args.set:
                cmd += ["--set", s]
            log = open(args.out / f"seed-{seed}.log", "w")  # noqa: SIM115 - lives with the process
            env = {
                **os.environ,
                "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            }
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running.append((seed, proc, time.time()))
            print(f"seed {seed}: started ({run})", flush=True)
        time.sleep(2)
        for item in list(running):
            seed, proc, start = item
            if proc.poll() is not None:
                running.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"seed {seed}: {status} in {time.time() - start:.0f} s", flush=True)
                if proc.returncode:
                    failed.append(seed)
    (args.out / "machine.txt").write_text(
        _machine() + f" {len(args.seeds)} seeds, {args.parallel} at a time, "
        f"{time.time() - t0:.0f} s wall in all.\n"
    )
    print(report(args.out))
    if failed:
        print(f"failed seeds: {failed} (logs: {args.out}/seed-S.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
