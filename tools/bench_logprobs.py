"""Peak CPU memory of log-probs + policy loss + backward: naive full logits vs the chunked head.

For each sequence length T the script runs one fresh subprocess per method. The subprocess
allocates the inputs — random final hidden states ``(T, H)`` and LM-head weight ``(V, H)``, both
requiring grad, targets, behaviour log-probs and advantages — reads its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``) as the baseline, then runs
``token_logprobs``/``naive_token_logprobs`` -> ``policy_loss`` (ppo) -> ``backward`` and reads
the peak again. The table reports the difference: the extra memory the computation needed.
A fresh process per measurement keeps one run's high-water mark out of the next.

Naive runs whose ``T * V * 4 * 3`` bytes (three float32 ``(T, V)`` buffers, a lower bound on what
autograd keeps) exceed ``--naive-limit-gb`` are skipped and reported as not fitting.

    python tools/bench_logprobs.py                      # T = 4k, 16k, 64k at V = 32k, H = 256
    python tools/bench_logprobs.py --out docs/learner.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 1024**2


def child(method: str, t: int, v: int, h: int, chunk: int, threads: int) -> None:
    """Measure one configuration in this (fresh) process and print a JSON line."""
    import torch

    from trainer.algo.logprobs import naive_token_logprobs, token_logprobs
    from trainer.algo.loss import LossConfig, policy_loss

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, t, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    targets = torch.randint(0, v, (1, t), generator=g)
    behavior = -torch.rand(1, t, generator=g) * 5
    adv = torch.randn(1, t, generator=g)
    mask = torch.ones(1, t, dtype=torch.bool)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    fn = token_logprobs if method == "chunked" else naive_token_logprobs
    t0 = time.perf_counter()
    logp = fn(hidden, weight, targets, chunk_size=chunk).logprobs
    loss = policy_loss(logp, behavior, adv, mask, LossConfig(loss_type="ppo")).loss
    loss.backward()
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    print(json.dumps({"extra_mb": (peak_kb - base_kb) / 1024, "seconds": seconds}))


def measure(method: str, t: int, v: int, h: int, chunk: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(t), str(v), str(h), str(chunk)]
    cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--naive-limit-gb", type=float, default=16.0)
    ap.add_argument("--out", type=Path, default=None, help="append a Markdown section here")
    ap.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        method, *nums = args.child
        child(method, *map(int, nums), threads=args.threads)
        return

    v, h, c = args.vocab, args.hidden, args.chunk_size
    rows = []
    lines = [
        "| T | T*V*4 (MB) | naive extra peak (MB) | naive s | chunked extra peak (MB) | "
        "chunked s | naive / chunked | chunked / (T*V*4) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in args.lengths:
        tv = t * v * 4 / MB
        need_gb = t * v * 4 * 3 / 1024**3
        chunked = measure("chunked", t, v, h, c, args.threads)
        if need_gb > args.naive_limit_gb:
            naive = None
            naive_cells = f"does not fit (would need > {need_gb:.0f} GB) | -"
            ratio = "-"
        else:
            naive = measure("naive", t, v, h, c, args.threads)
            naive_cells = f"{naive['extra_mb']:.0f} | {naive['seconds']:.1f}"
            ratio = f"{naive['extra_mb'] / max(chunked['extra_mb'], 1e-9):.1f}x"
        line = (
            f"| {t} | {tv:.0f} | {naive_cells} | {chunked['extra_mb']:.0f} | "
            f"{chunked['seconds']:.1f} | {ratio} | {chunked['extra_mb'] / tv:.3f} |"
        )
        rows.append({"T": t, "naive": naive, "chunked": chunked})
        lines.append(line)
        print(line if len(lines) > 3 else "\n".join(lines), flush=True)
    if args.out is not None:
        cmd = "python tools/bench_logprobs.py " + shlex.join(argv if argv else sys.argv[1:])
        section = [
            "",
            "## Log-prob memory: naive vs chunked",
            "",
            f"`{cmd.strip()}` ({datetime.date.today().isoformat()}, CPU, {args.threads} threads). "
            f"V={v}, H={h}, chunk_size={c}; extra peak RSS of log-probs + ppo loss + backward "
            "over the inputs' baseline, one fresh process per cell.",
            "",
            *lines,
            "",
        ]
        with args.out.open("a") as f:
            f.write("\n".join(section))


if __name__ == "__main__":
    main()
