"""Replay vs strictly on-policy RL at the same budget of generated tokens.

Starting from ``examples/arith.toml`` (tiny model, 1-digit addition, supervised warm start),
three configurations are trained with the sync loop of :func:`trainer.run.sync.train`:

* ``onpolicy``: every rollout is used exactly once. Rollouts per round (16 prompts x 8) equal
  ``updates_per_round x batch_size`` (2 x 64); replay ``window`` = rollouts per round,
  ``max_uses = 1``, ``max_staleness = updates_per_round``; loss ``ppo``.
* ``replay``: the FIFO buffer of Arnal et al. (2026): half the generation per round (8 prompts
  x 8 = 64 rollouts), the same 2 x 64 learner batches drawn uniformly from the 1024 most recent
  rollouts (replay ratio 2), plain ``ppo`` (clipped) loss against the stored behaviour
  log-probs. Staleness is bounded by the window alone (1024 / 64 rounds = 32 learner steps).
* ``replay_tis_div``: as ``replay`` with an off-policy correction (``--correction``, default
  ``tis``: truncated importance weights min(pi/mu, 2)) and ``diversity = "prompt"`` selection.
* ``replay_control``: as ``replay`` (or ``replay_tis_div``, ``--control-base``) with the
  replay-ratio controller on (``[replay.control]``, see ``trainer/control.py``): learner steps
  per round y start at 2 and move in [1, 4] between rounds from the ESS fraction, clip
  fraction, approx KL and reward trend of the last round (targets ``CONTROL`` below). Its
  ``run.steps`` is sized for y = 4 and ``run.max_generated_tokens`` stops it at the budget;
  it evaluates every 8 learner steps (512 generated rollouts when y = 1), so its eval points
  do not line up with the others' in tokens.

Equal budget: each run's ``run.steps`` is computed from rollouts per round and an assumed
``--tokens-per-rollout`` (deliberately below the ~3.5 actually seen, so every run overshoots),
then its metrics are truncated at the budget: only records whose cumulative
``generated_tokens`` is <= ``--token-budget`` count (a round that would overshoot the budget is
not used). Evaluations (held-out reward, 128 prompts) are placed every ``--eval-rollouts``
generated rollouts in every configuration, so eval points line up in tokens.

Reported per configuration (mean over seeds): generated tokens and gen+train seconds (the
loop's own ``gen_seconds + train_seconds``; no evals, model building or warm start) to the first
eval with held-out reward >= ``--target``, final held-out reward and final learner entropy
within the budget, and learner steps taken. Writes a Markdown report and
``<out stem>_reward_vs_tokens.png``.

Usage::

    .venv/bin/python tools/replay_vs_onpolicy.py                      # 2 seeds, 60k tokens
    .venv/bin/python tools/replay_vs_onpolicy.py --seeds 0 1 2 --token-budget 80000
    .venv/bin/python tools/replay_vs_onpolicy.py --quick              # 1 seed, 8k tokens
    .venv/bin/python tools/replay_vs_onpolicy.py --arms replay_control --no-report

Finished runs under ``--run-root`` whose config matches are reused (``--fresh`` reruns them).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.replay_common import load_base, read_metrics  # noqa: E402
from tools.replay_common import write_report as _write_report  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402

CONFIGS = ("onpolicy", "replay", "replay_tis_div", "replay_control")
LABELS = {
    "onpolicy": "(a) on-policy, each rollout used once",
    "replay": "(b) replay FIFO 1024, ratio 2, ppo",
    "replay_tis_div": "(c) replay + {correction} + prompt diversity",
    "replay_control": "(d) {control_base} + replay-ratio controller, y in [1, 4]",
}
# The controller of arm (d): y in [1, 4] from 2; back off when the last round's mean ESS
# fraction < 0.9, clip fraction > 0.1 (eps 0.2/0.28 clips a few % even near on-policy) or
# approx KL(mu -> pi) > 0.05, or the on-policy reward fell > 0.05 over 6 rounds by more than
# 2 standard errors of the fit (round-to-round noise is not a fall).
CONTROL = {
    "enabled": True,
    "min_updates": 1,
    "max_updates": 4,
    "target_ess": 0.9,
    "max_clip": 0.1,
    "max_kl": 0.05,
    "reward_window": 6,
    "reward_drop": 0.05,
    "reward_z": 2.0,
    # At y = 1 the 1024-row window still reaches ~16 rounds back: then draw more of each batch
    # from the newest round instead (fresh_fraction up to 0.5, in steps of 0.125).
    "adjust": "both",
    "max_fresh": 0.5,
    "fresh_step": 0.125,
}
PAPER = "https://arxiv.org/abs/2604.08706"


# -- configs ------------------------------------------------------------------------------------
def steps_for_budget(
    token_budget: int, rollouts_per_round: int, updates_per_round: int, tokens_per_rollout: float
) -> int:
    """Learner steps whose rounds generate at least ``token_budget`` tokens if each rollout
    has ``tokens_per_rollout`` completion tokens (use an under-estimate to overshoot)."""
    rounds = math.ceil(token_budget / (rollouts_per_round * tokens_per_rollout))
    return max(1, rounds) * updates_per_round


def build_configs(
    base: dict[str, Any],
    *,
    seed: int,
    token_budget: int,
    run_root: Path,
    tokens_per_rollout: float = 3.0,
    eval_rollouts: int = 512,
    correction: str = "tis",
    window: int = 1024,
    arms: tuple[str, ...] = CONFIGS,
    control_base: str = "replay",
) -> dict[str, TrainConfig]:
    """The configurations of ``arms`` for one seed, as validated ``TrainConfig`` objects."""
    group = base.get("generation", {}).get("group_size", 8)
    upr, batch = 2, 64
    per_round = {"onpolicy": upr * batch}
    out = {}
    for name in arms:
        kind = control_base if name == "replay_control" else name
        d = {k: dict(v) for k, v in base.items()}
        rollouts = per_round.get(name, batch)
        if rollouts % group:
            raise ValueError(f"{name}: {rollouts} rollouts per round is not a multiple of {group}")
        if eval_rollouts % rollouts:
            raise ValueError(f"eval_rollouts {eval_rollouts} must be a multiple of {rollouts}")
        steps = steps_for_budget(token_budget, rollouts, upr, tokens_per_rollout)
        d["generation"]["prompts_per_round"] = rollouts // group
        # The arms compare learning per generated token, which does not depend on the engine;
        # transformers keeps the recorded runs reusable whether or not vLLM is installed.
        d["generation"]["backend"] = "hf"
        d["run"].update(
            dir=str(run_root / f"{name}-s{seed}"),
            seed=seed,
            steps=steps,
            updates_per_round=upr,
            batch_size=batch,
            checkpoint_every=steps,
            keep_checkpoints=1,
        )
        d["eval"] = dict(d.get("eval", {}), every=eval_rollouts // rollouts * upr)
        if name == "replay_control":
            steps = steps_for_budget(
                token_budget, rollouts, CONTROL["max_updates"], tokens_per_rollout
            )
            d["run"].update(
                steps=steps,
                checkpoint_every=steps,
                max_generated_tokens=token_budget,
            )
            d["eval"]["every"] = eval_rollouts // rollouts
        replay = dict(d.get("replay", {}), seed=seed)
        # One initial model and learner seed for every run seed, as the recorded runs had
        # ([model] and [optim] seeds follow run.seed unless set).
        d.setdefault("model", {}).setdefault("seed", 0)
        d.setdefault("optim", {}).setdefault("seed", 0)
        loss = dict(d.get("loss", {}))
        if name == "onpolicy":
            replay.update(window=rollouts, max_uses=1, max_staleness=upr, diversity="none")
            loss["loss_type"] = "ppo"
        else:
            replay.update(window=window, max_uses=None, max_staleness=None)
            replay["diversity"] = "prompt" if kind == "replay_tis_div" else "none"
            loss["loss_type"] = correction if kind == "replay_tis_div" else "ppo"
        if name == "replay_control":
            replay["control"] = dict(CONTROL)
        replay.setdefault("priority", "uniform")
        d["replay"], d["loss"] = replay, loss
        out[name] = TrainConfig.from_dict(d)
    return out


# -- running ------------------------------------------------------------------------------------
def finished(cfg: TrainConfig) -> bool:
    run_dir = Path(cfg.run.dir)
    meta = run_dir / "run.json"
    # Compare as configs, so that runs stored before a key with a default existed still match.
    if not meta.exists() or TrainConfig.from_dict(json.loads(meta.read_text())["config"]) != cfg:
        return False
    recs = read_metrics(run_dir)
    budget = cfg.run.max_generated_tokens
    stopped = budget and any(
        r["kind"] == "eval" and r.get("generated_tokens", 0) >= budget for r in recs
    )
    return bool(stopped) or any(r["kind"] == "train" and r["step"] == cfg.run.steps for r in recs)


def run_one(cfg: TrainConfig, fresh: bool) -> float:
    """Train (or reuse) one run; returns the wall seconds spent (0 when reused)."""
    from trainer.run.sync import train

    if not fresh and finished(cfg):
        print(f"reuse {cfg.run.dir}", flush=True)
        return 0.0
    shutil.rmtree(cfg.run.dir, ignore_errors=True)
    t0 = time.perf_counter()
    res = train(cfg, progress=False)
    dt = time.perf_counter() - t0
    print(
        f"{cfg.run.dir}: {res.steps} steps, eval {res.first_eval:.3f} -> {res.last_eval:.3f}, "
        f"{dt:.0f} s",
        flush=True,
    )
    return dt


# -- summarising --------------------------------------------------------------------------------
def summarise(recs: list[dict[str, Any]], budget: int, target: float) -> dict[str, Any]:
    """One run's numbers within the token budget."""
    train = [r for r in recs if r["kind"] == "train" and r["generated_tokens"] <= budget]
    evals = [r for r in recs if r["kind"] == "eval" and r.get("generated_tokens", 0) <= budget]
    spent = max((r["generated_tokens"] for r in train), default=0)
    hit = next((r for r in evals if r["reward"] >= target), None)
    return {
        "curve": [(r.get("generated_tokens", 0), r["reward"]) for r in evals],
        "tokens": spent,
        "steps": train[-1]["step"] if train else 0,
        "final_reward": evals[-1]["reward"] if evals else float("nan"),
        "first_reward": evals[0]["reward"] if evals else float("nan"),
        "final_entropy": train[-1]["entropy"] if train else float("nan"),
        "seconds": (train[-1]["gen_seconds"] + train[-1]["train_seconds"]) if train else 0.0,
        "hit_tokens": hit.get("generated_tokens", 0) if hit else None,
        "hit_seconds": (hit.get("gen_seconds", 0.0) + hit.get("train_seconds", 0.0))
        if hit
        else None,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _hit(values: list[float | None], fmt: str) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    s = format(_mean(got), fmt)
    return s if len(got) == len(values) else f"{s} ({len(got)}/{len(values)} seeds)"


def label(name: str, correction: str, control_base: str = "replay") -> str:
    base = LABELS[control_base].split(" ", 1)[0] if control_base in LABELS else control_base
    return LABELS[name].format(correction=correction, control_base=base)


def table(
    summ: dict[str, list[dict[str, Any]]],
    target: float,
    correction: str,
    control_base: str = "replay",
) -> str:
    head = (
        f"| configuration | tokens to eval >= {target} | gen+train s to {target} "
        "| final eval reward | final entropy | learner steps | tokens used | gen+train s |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name, runs in summ.items():
        per_seed = ", ".join(f"{r['final_reward']:.3f}" for r in runs)
        rows.append(
            f"| {label(name, correction, control_base)} "
            f"| {_hit([r['hit_tokens'] for r in runs], ',.0f')} "
            f"| {_hit([r['hit_seconds'] for r in runs], '.1f')} "
            f"| {_mean([r['final_reward'] for r in runs]):.3f} ({per_seed}) "
            f"| {_mean([r['final_entropy'] for r in runs]):.3f} "
            f"| {_mean([r['steps'] for r in runs]):.0f} "
            f"| {_mean([r['tokens'] for r in runs]):,.0f} "
            f"| {_mean([r['seconds'] for r in runs]):.1f} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(summ, path: Path, target: float, correction: str, control_base: str = "replay") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, runs) in enumerate(summ.items()):
        color = f"C{i}"
        for r in runs:
            xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
            ax.plot(xs, ys, color=color, alpha=0.25, lw=1)
        n = min(len(r["curve"]) for r in runs)
        mx = [_mean([r["curve"][k][0] for r in runs]) for k in range(n)]
        my = [_mean([r["curve"][k][1] for r in runs]) for k in range(n)]
        ax.plot(
            mx,
            my,
            color=color,
            lw=2,
            marker="o",
            ms=3,
            label=label(name, correction, control_base),
        )
    ax.axhline(target, color="grey", ls="--", lw=1)
    ax.set_xlabel("generated completion tokens")
    ax.set_ylabel("held-out reward (128 prompts)")
    ax.set_title(f"arith, tiny model: mean over {len(next(iter(summ.values())))} seed(s)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path, block: str) -> None:
    """Replace the generated block between the markers of ``out``, keeping the text around it."""
    head = (
        "# Replay vs on-policy at equal generated tokens\n\n"
        "See the docstring of `tools/replay_vs_onpolicy.py`.\n\n"
    )
    _write_report(out, block, head)


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples/arith.toml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--token-budget", type=int, default=60_000, help="generated tokens per run")
    ap.add_argument("--target", type=float, default=0.6, help="held-out reward to reach")
    ap.add_argument(
        "--tokens-per-rollout",
        type=float,
        default=3.0,
        help="assumed tokens per rollout when computing run.steps (under-estimate)",
    )
    ap.add_argument(
        "--eval-rollouts",
        type=int,
        default=512,
        help="generated rollouts between evals (a multiple of 128)",
    )
    ap.add_argument("--correction", choices=("tis", "decoupled", "icepop"), default="tis")
    ap.add_argument("--window", type=int, default=1024, help="FIFO capacity of (b) and (c)")
    ap.add_argument(
        "--arms", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="configurations to run"
    )
    ap.add_argument(
        "--control-base",
        choices=("replay", "replay_tis_div"),
        default="replay",
        help="the arm (d) adds the controller to",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results.md")
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs/compare")
    ap.add_argument("--fresh", action="store_true", help="rerun even finished matching runs")
    ap.add_argument("--quick", action="store_true", help="1 seed, 8k tokens (a smoke run)")
    ap.add_argument("--no-report", action="store_true", help="print the table, write nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.token_budget = args.seeds[:1], min(args.token_budget, 8_000)

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    base = load_base(args.config)
    arms = tuple(a for a in CONFIGS if a in args.arms)
    summ: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    t_all = time.perf_counter()
    for seed in args.seeds:
        cfgs = build_configs(
            base,
            seed=seed,
            token_budget=args.token_budget,
            run_root=args.run_root,
            tokens_per_rollout=args.tokens_per_rollout,
            eval_rollouts=args.eval_rollouts,
            correction=args.correction,
            window=args.window,
            arms=arms,
            control_base=args.control_base,
        )
        for name, cfg in cfgs.items():
            run_one(cfg, args.fresh)
            s = summarise(read_metrics(Path(cfg.run.dir)), args.token_budget, args.target)
            if s["tokens"] < args.token_budget * 0.95:
                print(f"warning: {cfg.run.dir} used only {s['tokens']} of the budget")
            summ[name].append(s)
    elapsed = time.perf_counter() - t_all
    tab = table(summ, args.target, args.correction, args.control_base)
    print(tab)
    print(f"total {elapsed:.0f} s")
    if args.no_report:
        return 0
    png = args.out.with_name(args.out.stem + "_reward_vs_tokens.png")
    plot(summ, png, args.target, args.correction, args.control_base)
    figures = f"![held-out reward vs generated tokens]({png.name})\n"
    if "replay_control" in arms:
        from trainer.run.plot import plot_run

        run0 = args.run_root / f"replay_control-s{args.seeds[0]}"
        ctl = next(p for p in plot_run(run0) if p.name == "control.png")
        ctl_png = args.out.with_name(args.out.stem + "_control.png")
        shutil.copyfile(ctl, ctl_png)
        figures += (
            f"\n![(d): learner steps per round and the controller's inputs, seed "
            f"{args.seeds[0]}]({ctl_png.name})\n"
        )
    cmd = "python tools/replay_vs_onpolicy.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    block = (
        f"Command: `{cmd.strip()}` ({len(args.seeds)} seed(s), budget "
        f"{args.token_budget:,} generated tokens per run, target {args.target}, "
        f"{elapsed:.0f} s wall in total, torch threads {args.threads or 'default'})\n\n{tab}\n"
        f"{figures}"
    )
    write_report(args.out, block)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
