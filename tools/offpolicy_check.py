"""Bias and variance of each policy loss's gradient on stale data, against the exact gradient.

The problem is small enough to solve exactly: a two-step autoregressive softmax policy over
``K`` tokens, ``pi(y1, y2) = softmax(theta1)[y1] * softmax(theta2[y1])[y2]``, and a fixed reward
table ``R(y1, y2)``. The objective ``J(theta) = E_pi[R]`` and its gradient are computed by
enumerating all ``K^2`` sequences. Exact gradient ascent on ``J`` from a random start gives a
trajectory ``theta_0 .. theta_T``; the learner sits at ``theta_T`` and its data at staleness ``s``
were sampled from ``theta_{T-s}`` (the behaviour policy mu, whose log-probs are stored with the
data, as in the replay buffer).

For every loss type, :func:`trainer.algo.loss.policy_loss` is applied to the per-token tensors of a
batch (advantage ``R - J(theta_T)``, the exact value as baseline so the baseline adds no bias;
aggregation ``seq-mean-token-sum`` so the on-policy expectation is exactly ``-grad J``;
``pi_prox`` = the current policy, as in the learner) and differentiated w.r.t. ``theta``.
Over many batches:

* bias     = ||E[g] - g_true|| / ||g_true||, with ``g_true = -grad J(theta_T)``;
* cosine   = cos(E[g], g_true): does the expected update still point the right way;
* variance = E||g - E[g]||^2 / ||g_true||^2 (per batch of ``--batch`` sequences).

Each of ``--seeds`` seeds is a different problem (reward table, start, trajectory); the table
gives the mean over seeds and, for bias, the spread (min-max). Besides the seven loss types
with their defaults it checks the variants the defaults changed (ppo without the dual clip,
decoupled uncapped, icepop renormalised). The bias estimate itself has Monte-Carlo noise of
about sqrt(variance / batches); the table prints that floor. Run::

    python tools/offpolicy_check.py                       # prints the table
    python tools/offpolicy_check.py --out docs/learner.md # also appends it as Markdown
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.algo.loss import LOSS_TYPES, LossConfig, policy_loss  # noqa: E402

STALENESS = (0, 2, 8, 32)
# (row name, LossConfig) of every loss checked: the defaults, then the variants.
VARIANTS = [(lt, LossConfig(loss_type=lt, agg="seq-mean-token-sum")) for lt in LOSS_TYPES] + [
    ("ppo, no dual clip", LossConfig(agg="seq-mean-token-sum", clip_ratio_c=None)),
    ("decoupled, uncapped", LossConfig("decoupled", "seq-mean-token-sum", decoupled_cap=None)),
    ("icepop, renorm", LossConfig("icepop", "seq-mean-token-sum", icepop_renorm=True)),
]


def log_policy(theta1: torch.Tensor, theta2: torch.Tensor) -> torch.Tensor:
    """``(K, K)`` log pi(y1, y2) — all sequences of the two-step policy."""
    return torch.log_softmax(theta1, -1)[:, None] + torch.log_softmax(theta2, -1)


def objective(theta1: torch.Tensor, theta2: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    return (log_policy(theta1, theta2).exp() * reward).sum()


def trajectory(k: int, steps: int, lr: float, seed: int):
    """Exact gradient-ascent iterates ``[(theta1, theta2)] * (steps + 1)`` and the reward table."""
    g = torch.Generator().manual_seed(seed)
    reward = torch.rand(k, k, generator=g, dtype=torch.float64)
    theta1 = torch.randn(k, generator=g, dtype=torch.float64) * 0.5
    theta2 = torch.randn(k, k, generator=g, dtype=torch.float64) * 0.5
    out = [(theta1.clone(), theta2.clone())]
    for _ in range(steps):
        t1, t2 = theta1.clone().requires_grad_(), theta2.clone().requires_grad_()
        g1, g2 = torch.autograd.grad(objective(t1, t2, reward), (t1, t2))
        theta1, theta2 = theta1 + lr * g1, theta2 + lr * g2
        out.append((theta1.clone(), theta2.clone()))
    return out, reward


def per_token_logp(theta1: torch.Tensor, theta2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(N, 2)`` log-probs of the two tokens of each sampled sequence ``y`` ``(N, 2)``."""
    lp1 = torch.log_softmax(theta1, -1)[y[:, 0]]
    lp2 = torch.log_softmax(theta2, -1)[y[:, 0], y[:, 1]]
    return torch.stack([lp1, lp2], dim=1)


def run(k: int, batch: int, batches: int, lr: float, seed: int) -> dict:
    traj, reward = trajectory(k, max(STALENESS), lr, seed)
    cur1, cur2 = traj[-1]
    t1, t2 = cur1.clone().requires_grad_(), cur2.clone().requires_grad_()
    value = objective(t1, t2, reward)
    g_true = -torch.cat([x.flatten() for x in torch.autograd.grad(value, (t1, t2))])
    value = float(value.detach())
    norm2 = float(g_true @ g_true)
    gen = torch.Generator().manual_seed(seed + 1)
    results: dict = {"kl": {}, "value": value, "grad_norm": math.sqrt(norm2)}
    for s in STALENESS:
        mu1, mu2 = traj[-1 - s]
        log_mu = log_policy(mu1, mu2)
        log_pi = log_policy(cur1, cur2)
        results["kl"][s] = float((log_mu.exp() * (log_mu - log_pi)).sum())
        grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in VARIANTS}
        for _ in range(batches):
            # The same samples for every loss type (common random numbers) sharpen the comparison.
            flat = torch.multinomial(log_mu.exp().flatten(), batch, replacement=True, generator=gen)
            y = torch.stack([flat // k, flat % k], dim=1)
            behavior = per_token_logp(mu1, mu2, y)
            adv = (reward[y[:, 0], y[:, 1]] - value)[:, None].expand(-1, 2)
            mask = torch.ones(batch, 2, dtype=torch.bool)
            for name, cfg in VARIANTS:
                t1, t2 = cur1.clone().requires_grad_(), cur2.clone().requires_grad_()
                logp = per_token_logp(t1, t2, y)
                out = policy_loss(logp, behavior, adv, mask, cfg, prox_logp=logp.detach())
                g1, g2 = torch.autograd.grad(out.loss, (t1, t2))
                grads[name].append(torch.cat([g1.flatten(), g2.flatten()]))
        for name, _ in VARIANTS:
            g = torch.stack(grads[name])
            mean = g.mean(0)
            bias = float((mean - g_true).norm()) / math.sqrt(norm2)
            var = float(((g - mean) ** 2).sum(1).mean()) / norm2
            cos = float(mean @ g_true) / (float(mean.norm()) * math.sqrt(norm2) + 1e-30)
            results.setdefault(name, {})[s] = (bias, var, cos)
    return results


def over_seeds(runs: list[dict]) -> dict:
    """Per (loss, staleness): (mean bias, min bias, max bias, mean var, mean cosine)."""
    out: dict = {"kl": {s: sum(r["kl"][s] for r in runs) / len(runs) for s in STALENESS}}
    for name, _ in VARIANTS:
        for s in STALENESS:
            bias, var, cos = zip(*(r[name][s] for r in runs))
            n = len(runs)
            out.setdefault(name, {})[s] = (sum(bias) / n, min(bias), max(bias), sum(var) / n,
                                           sum(cos) / n)  # fmt: skip
    return out


def table(res: dict, batches: int) -> list[str]:
    head = "| loss | " + " | ".join(f"s={s}: bias [min-max] / cos / var" for s in STALENESS)
    lines = [head + " |", "|" + "---|" * (len(STALENESS) + 1)]
    kl = " | ".join(f"{res['kl'][s]:.3f}" for s in STALENESS)
    lines.append(f"| KL(mu \\|\\| pi), mean | {kl} |")
    for name, _ in VARIANTS:
        cells = " | ".join(
            "{:.2f} [{:.2f}-{:.2f}] / {:.3f} / {:.2f}".format(*res[name][s][:3], *res[name][s][4:],
                                                             res[name][s][3])
            for s in STALENESS
        )  # fmt: skip
        lines.append(f"| {name} | {cells} |")
    floor = " | ".join(f"{math.sqrt(res['ppo'][s][3] / batches):.3f}" for s in STALENESS)
    lines.append(f"| noise floor of bias (ppo) | {floor} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=6, help="tokens per step")
    ap.add_argument("--batch", type=int, default=64, help="sequences per batch")
    ap.add_argument("--batches", type=int, default=400, help="batches per (loss, staleness)")
    ap.add_argument("--lr", type=float, default=2.0, help="gradient-ascent step of the trajectory")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=5, help="problems (seeds) averaged over")
    ap.add_argument("--out", type=Path, default=None, help="append a Markdown section here")
    args = ap.parse_args(argv)
    for name in ("k", "batch", "batches"):
        if getattr(args, name) < 2:
            raise SystemExit(f"--{name} must be >= 2, got {getattr(args, name)}")

    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    runs = [
        run(args.k, args.batch, args.batches, args.lr, args.seed + 1000 * i)
        for i in range(args.seeds)
    ]
    res = over_seeds(runs)
    lines = table(res, args.batches)
    values = ", ".join(f"{r['value']:.3f}" for r in runs)
    norms = ", ".join(f"{r['grad_norm']:.4f}" for r in runs)
    about = f"J(theta_T) = {values}; ||grad J|| = {norms}"
    print(f"K={args.k}, batch={args.batch}, batches={args.batches}, seeds={args.seeds}; {about}")
    print("\n".join(lines))
    if args.out is not None:
        cmd = "python tools/offpolicy_check.py " + shlex.join(argv if argv else sys.argv[1:])
        section = [
            "",
            "## Off-policy gradient check",
            "",
            f"`{cmd.strip()}` ({datetime.date.today().isoformat()}). Two-step softmax policy, "
            f"K={args.k}, {args.batches} batches of {args.batch} sequences per cell, "
            f"{args.seeds} seeds (problems; mean, bias spread min-max); {about}. "
            "bias = ||E g - g_true|| / ||g_true||, cos = cos(E g, g_true), "
            "var = E||g - E g||^2 / ||g_true||^2.",
            "",
            *lines,
            "",
        ]
        with args.out.open("a") as f:
            f.write("\n".join(section))


if __name__ == "__main__":
    main()
