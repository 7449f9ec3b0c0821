"""Behaviour log-probs as the generators store them vs the learner's recomputation, per dtype.

    python tools/bench_logprob_gap.py                          # SmolLM2 (make smollm2), hf + vllm
    python tools/bench_logprob_gap.py --backends hf --dtypes bfloat16 --prompts 4
    python tools/bench_logprob_gap.py --model PATH --temperature 0.7 --top-p 0.9

For each backend x dtype a generator at the model's weights samples chat-rendered arith prompts;
the learner recomputes every sampled token's log-prob from the float32 weights the way it trains
(autocast in the same dtype, LM head and processed softmax in float32:
:func:`trainer.algo.behavior.behavior_gaps`). Prints the per-token gap (tokens, mean, p50, p99,
max, top-p flips), the clipped mean that verifies a bf16 vLLM update
(trainer/rollout/vllm_update.py), and generated tokens/s. The figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Running as a script puts tools/ (not the repo root) on sys.path.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.algo.behavior import behavior_gaps, gap_summary  # noqa: E402
from trainer.models.load import DTYPES, load_model  # noqa: E402
from trainer.tasks import get_task  # noqa: E402
from trainer.tasks.chat import render_prompts  # noqa: E402


def generator(backend: str, model: Path, dtype: str, seed: int):
    if backend == "hf":
        from trainer.rollout.hf import HFGenerator

        return HFGenerator(model, dtype=DTYPES[dtype])
    from trainer.rollout.vllm import VLLMGenerator

    # Eager (no torch.compile): a faster start, the same numerics.
    return VLLMGenerator(model, dtype=dtype, seed=seed, enforce_eager=True, max_model_len=1024)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2" / "fp32")
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"no model at {args.model}: run `make smollm2` (or pass --model)")
    learner, tok = load_model(args.model)  # float32 weights, as the learner holds them
    learner.eval()
    task = get_task("arith", chat_template=True, max_operands=2, max_digits=2, ops=["+"])
    texts = [q.prompt_text for q in render_prompts(tok, task.make_prompts(args.prompts, 0), True)]
    print(f"{args.model}: {args.prompts} prompts x {args.group_size}, <= {args.max_tokens} "
          f"tokens, T {args.temperature}, top-p {args.top_p}; torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    print(f"{'backend':8} {'dtype':9} {'tokens':>6} {'mean':>9} {'p50':>9} {'p99':>9} "
          f"{'max':>9} {'flips':>5} {'clip.mean':>9} {'gen tok/s':>9}")  # fmt: skip
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            gen = generator(backend, args.model, dtype, args.seed)
            try:
                t0 = time.perf_counter()
                rows = gen.generate(
                    texts, group_size=args.group_size, temperature=args.temperature,
                    top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                )  # fmt: skip
                seconds = time.perf_counter() - t0
            finally:
                if hasattr(gen, "close"):
                    gen.close()
            gaps = behavior_gaps(learner, rows, DTYPES[dtype])
            s = gap_summary(gaps)
            print(f"{backend:8} {dtype:9} {s['tokens']:6d} {s['mean']:9.2e} {s['p50']:9.2e} "
                  f"{s['p99']:9.2e} {s['max']:9.2e} {s['flips']:5d} "
                  f"{float(gaps.clamp(max=1.0).mean()):9.2e} "
                  f"{s['tokens'] / seconds:9.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
