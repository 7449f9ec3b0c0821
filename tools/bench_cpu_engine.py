"""vLLM CPU generation speed on a real model: the cores it binds, float32 vs bfloat16.

    python tools/bench_cpu_engine.py                       # SmolLM2-135M from .cache/smollm2/fp32
    python tools/bench_cpu_engine.py --model DIR --prompts 32 --max-tokens 64   # the docs table

Four engine starts (eager, as the trainer starts them on CPU), each in its own process because
vLLM reads its CPU binding from the environment at start-up:

- *vLLM default binding* (``VLLM_CPU_OMP_THREADS_BIND=auto``, set explicitly so the trainer's
  own setting stands aside): one core is reserved for vLLM's scheduler process and torch gets the
  others (1 thread on a 2-core machine);
- *all cores* (what the trainer sets for a sync run, ``[run] threads`` = all cores:
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, trainer/rollout/vllm_env.py);

each in float32 and bfloat16. Each process starts the engine, generates one warm-up batch, then
times ``--prompts`` chat prompts x ``--max-tokens`` tokens (min_tokens = max_tokens, so every
run generates the same number of tokens) and prints generated tokens per second. The table puts
them side by side with the ratios. About 4-5 minutes on SmolLM2-135M with 2 quiet cores.
Scripts that start vLLM must do it under ``if __name__ == "__main__":`` (spawned workers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [  # (label, dtype, environment)
    ("float32, vLLM default binding", "float32", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
    ("float32, all cores", "float32", {}),
    ("bfloat16, vLLM default binding", "bfloat16", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
    ("bfloat16, all cores", "bfloat16", {}),
]


def measure(model: str, dtype: str, prompts: int, max_tokens: int, log: str) -> dict:
    """One engine: start it, warm up, time one batch; {start_s, tokens, seconds}."""
    from vllm import SamplingParams

    from trainer.rollout.vllm import VLLMGenerator

    t0 = time.perf_counter()
    gen = VLLMGenerator(model, dtype=dtype, max_model_len=512, kv_cache_gib=0.25, engine_log=log)
    start = time.perf_counter() - t0
    questions = [f"What is {i} + {2 * i + 7}? Answer briefly." for i in range(prompts)]
    ids = [
        gen.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, seed=0)
    llm = gen._llm
    llm.generate([{"prompt_token_ids": x} for x in ids[:4]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for r in out for c in r.outputs)
    gen.close()
    return {"start_s": start, "tokens": tokens, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".cache" / "smollm2" / "fp32"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config, print JSON
    args = ap.parse_args()
    if args.one is not None:
        label, dtype, log = json.loads(args.one)
        result = measure(args.model, dtype, args.prompts, args.max_tokens, log)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no model folder (tools/make_smollm2.py builds it)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, dtype, env in CONFIGS:
            log = str(Path(tmp) / f"{len(results)}.log")
            cmd = [sys.executable, __file__, "--model", args.model, "--prompts",
                   str(args.prompts), "--max-tokens", str(args.max_tokens),
                   "--one", json.dumps([label, dtype, log])]  # fmt: skip
            p = subprocess.run(
                cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900
            )
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                sys.exit(f"{label}: failed\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            results[label] = json.loads(line.removeprefix("RESULT "))
            r = results[label]
            print(f"{label}: {r['tokens'] / r['seconds']:.0f} tok/s "
                  f"(engine start {r['start_s']:.0f} s)", flush=True)  # fmt: skip
    rate = {k: v["tokens"] / v["seconds"] for k, v in results.items()}
    print(f"\n{os.cpu_count()} cores, {args.prompts} prompts x {args.max_tokens} tokens, eager")
    print(f"{'':10s} {'vLLM default':>14s} {'all cores':>12s} {'ratio':>7s}")
    for dtype in ("float32", "bfloat16"):
        d, a = rate[f"{dtype}, vLLM default binding"], rate[f"{dtype}, all cores"]
        print(f"{dtype:10s} {d:11.0f} t/s {a:9.0f} t/s {a / d:6.2f}x")
    f32, b16 = rate["float32, all cores"], rate["bfloat16, all cores"]
    print(f"bfloat16 / float32 (all cores): {b16 / f32:.2f}x")


if __name__ == "__main__":
    main()
