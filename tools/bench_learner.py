"""Learner speed on a real model: the project's learner step vs a plain transformers step.

What the project's learner adds to a forward + backward is measured on the same batches of the
same model, side by side, in one run:

- ``learner``: :meth:`trainer.algo.learner.Learner.step` on batches drawn from a real store by
  :class:`rolloutstore.ReplayDataset` (behaviour log-probs, sampling settings, PPO clip,
  diagnostics, grad clip, AdamW);
- ``plain``: the baseline a user would write: ``model(input_ids, attention_mask).logits`` ->
  float32 ``log_softmax`` -> gather -> REINFORCE loss -> backward -> AdamW, same dtype policy
  (autocast on CUDA);
- where the time goes: a no-grad forward through the learner's log-prob head
  (``trainer.algo.logprobs.sequence_logprobs``, chunked LM head) vs transformers' full logits,
  and, with LoRA, the merge that gives a generator its weights
  (``trainer.models.lora.generator_state``), which a sync run pays once per weight update.

Rows are random token ids (prompt ~40, completions lognormal around ``--completion-len``) with
behaviour log-probs from the model itself, so ratios are ~1 as in an on-policy step; throughput
does not depend on which ids they are. Tokens/s count every token of the batch.

Both sides get the same padded batches, dtype, threads and attention (sdpa), and they alternate
batch by batch (learner, plain, learner, plain, ...), as do the two forwards; the table gives
medians, so a load change on a shared machine hurts both sides alike. Beside wall time it gives
this process's CPU seconds, which other processes' load disturbs less.

    python tools/bench_learner.py                                   # SmolLM2 (make smollm2), LoRA 16
    python tools/bench_learner.py --lora 0 --batch 16               # every weight trained
    python tools/bench_learner.py --model M --device cuda --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rows(model, args, device, rng) -> list[dict]:
    """Random rows whose behaviour log-probs are the model's own (no grad)."""
    import numpy as np
    import torch

    from trainer.algo.logprobs import sequence_logprobs

    vocab = model.config.vocab_size
    rows = []
    n = args.batch * (args.reps + 1)
    for i in range(n):
        p = int(rng.integers(args.prompt_len // 2, args.prompt_len * 3 // 2 + 1))
        c = int(
            np.clip(rng.lognormal(np.log(args.completion_len), 0.4), 4, 4 * args.completion_len)
        )
        prompt = rng.integers(0, vocab, size=p).tolist()
        completion = rng.integers(0, vocab, size=c).tolist()
        with torch.no_grad():
            ids = torch.tensor([prompt + completion], device=device)
            lp = sequence_logprobs(model, ids).logprobs[0, p - 1 :].float().cpu()
        rows.append(
            {
                "run_id": "bench",
                "group_id": f"g{i // 8}",
                "sample_index": i % 8,
                "policy_version": 0,
                "prompt_ids": prompt,
                "completion_ids": completion,
                "behavior_logprobs": lp.tolist(),
                "reward": float(rng.random() < 0.5),
                "advantage": float(rng.normal()),
                "temperature": 1.0,
            }
        )
    return rows


def _plain_step(model, opt, batch, device, dtype) -> None:
    import torch

    ids = batch["input_ids"].to(device)
    attn = batch["attention_mask"].to(device)
    mask = batch["loss_mask"].to(device) > 0
    adv = batch["advantages"].to(device)
    ctx = (
        torch.autocast(device.type, dtype=dtype)
        if dtype in (torch.bfloat16, torch.float16)
        else torch.autocast(device.type, enabled=False)
    )
    with ctx:
        logits = model(input_ids=ids, attention_mask=attn).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = -(adv * logp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(fn, device) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - w0, time.process_time() - c0


def interleaved(sides: dict[str, Callable[[Any], Any]], batches: list, device) -> dict:
    """Every side on every batch, alternating sides batch by batch (A B A B ...), so that a
    change of machine load falls on all sides alike: ``{side: [(wall, cpu), ...]}``."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for b in batches:
        for name, fn in sides.items():
            out[name].append(_timed(lambda fn=fn, b=b: fn(b), device))
    return out


def _median(pairs: list[tuple[float, float]], k: int) -> float:
    # The first batch of each side is its warm-up (allocator, kernels, AdamW state).
    return statistics.median(p[k] for p in pairs[1:])


def _table(args, device, dtype, tokens: list[int], results: dict, merge) -> str:
    import torch

    per_step = statistics.median(tokens[1:])
    lines = [
        "",
        f"**Learner speed** ({datetime.date.today()}, `tools/bench_learner.py`): "
        f"{Path(args.model).name} on {device} ({torch.get_num_threads()} threads), "
        f"{str(dtype).removeprefix('torch.')}, "
        f"{'LoRA rank ' + str(args.lora) if args.lora else 'all weights'}, "
        f"{args.batch} rows/step, median {per_step:.0f} tokens/step; medians of {args.reps} "
        "steps per side after 1 warm-up, sides interleaved batch by batch "
        f"(load average before / after: {args.load_before} / {os.getloadavg()[0]:.1f}).",
        "",
        "| method | wall s/step | tokens/s (wall) | CPU s/step | plain / method (wall, CPU) |",
        "|---|---|---|---|---|",
    ]
    for name, secs in results.items():
        ref = "plain fwd+bwd+AdamW" if "forward" not in name else FWD_REF
        wall, cpu = _median(secs, 0), _median(secs, 1)
        ratio = f"{_median(results[ref], 0) / wall:.2f}x, {_median(results[ref], 1) / cpu:.2f}x"
        lines.append(f"| {name} | {wall:.3f} | {per_step / wall:,.0f} | {cpu:.3f} | {ratio} |")
    if merge is not None:
        lines.append(
            f"| LoRA merge for the generator (`generator_state`) | {_median(merge, 0):.3f} | - "
            f"| {_median(merge, 1):.3f} | - |"
        )
    return "\n".join(lines)


FWD_REF = "forward: transformers logits + log_softmax"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "smollm2" / "fp32"))
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16"
    )
    ap.add_argument("--lora", type=int, default=16, help="LoRA rank (0: train every weight)")
    ap.add_argument("--batch", type=int, default=32, help="rows per step")
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per side (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: default)")
    ap.add_argument("--out", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    args.load_before = f"{os.getloadavg()[0]:.1f}"

    import numpy as np
    import torch

    from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
    from trainer.algo.learner import Learner
    from trainer.algo.logprobs import sequence_logprobs
    from trainer.algo.loss import LossConfig
    from trainer.algo.optim import OptimConfig
    from trainer.models.load import load_model, resolve_device, resolve_dtype
    from trainer.models.lora import LoraSettings, apply_lora, generator_state

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    base, _ = load_model(Path(args.model), attn_implementation="sdpa")
    if args.lora:
        base = apply_lora(base, LoraSettings(rank=args.lora, alpha=2.0 * args.lora), seed=0)
    base.to(device)
    rng = np.random.default_rng(0)
    print(f"building {args.batch * (args.reps + 1)} rows on {device} ...", flush=True)
    rows = _rows(base, args, device, rng)
    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore.open(Path(tmp) / "store", embedding_dim=8)
        store.append(rows)
        ds = ReplayDataset(
            store,
            ReplayConfig(seed=0),
            batch_size=args.batch,
            steps=args.reps + 1,
            learner_version=0,
            record_usage=False,
            prefetch=0,
        )
        batches = list(ds)
    tokens = [int(b["attention_mask"].sum()) for b in batches]

    learner = Learner(
        copy.deepcopy(base),
        LossConfig(loss_type="ppo"),
        OptimConfig(lr=1e-5, grad_clip=1.0),
        device=device,
        compute_dtype=dtype,
    )
    plain = copy.deepcopy(base).train()
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-5)
    print("timing the steps, interleaved ...", flush=True)
    results = interleaved(
        {
            "learner step": learner.step,
            "plain fwd+bwd+AdamW": lambda b: _plain_step(plain, opt, b, device, dtype),
        },
        batches,
        device,
    )
    learner = None  # free its weights and AdamW state before the forwards

    # Where the time goes: the forwards alone (no grad), the learner's head vs full logits.
    plain.eval()
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else torch.no_grad()

    def head(b):
        with torch.no_grad(), ctx:
            sequence_logprobs(
                plain,
                b["input_ids"].to(device),
                attention_mask=b["attention_mask"].to(device),
                position_ids=b["position_ids"].to(device),
            )

    def logits(b):
        with torch.no_grad(), ctx:
            out = plain(
                input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)
            ).logits
            torch.log_softmax(out.float(), dim=-1)

    print("timing the forwards, interleaved ...", flush=True)
    results.update(
        interleaved({"forward: learner log-prob head": head, FWD_REF: logits}, batches, device)
    )
    merge = None
    if args.lora:
        merge = [_timed(lambda: generator_state(plain), device) for _ in range(args.reps + 1)]

    text = _table(args, device, dtype, tokens, results, merge)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
