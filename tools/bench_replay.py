"""Replay benchmark: selection latency vs store size, and loader throughput vs in-memory.

    python tools/bench_replay.py                         # 100k, 1M, 4M rows; window 16k
    python tools/bench_replay.py --sizes 100000 1000000  # quicker

Part 1 grows one store (appends of 8,192 proxy rollouts, 2,048 per policy version,
short token lists: selection never reads tokens) and at each size times
``Selector.sample(256, ...)`` for every strategy: p50/p95 over warm draws, and the
first (cold) draw, which reads each fragment's version counts once.
Part 2 times the packed loader (``ReplayDataset``, 64k-token batches) on proxy
rollouts of realistic length against an in-memory baseline that holds the same
rollouts as a list of numpy arrays and packs the same rows into tensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore, Selector
from rolloutstore.io.proxy import proxy_batches

STRATEGIES = {
    "uniform-window": ReplayConfig(window=16384, seed=0),
    "staleness-4": ReplayConfig(window=16384, max_staleness=4, seed=0),
    "max-uses-4": ReplayConfig(window=16384, max_uses=4, seed=0),
    "whole-groups": ReplayConfig(window=16384, whole_groups=True, seed=0),
    "positive-0.25": ReplayConfig(
        window=16384, positive_fraction=0.25, positive_threshold=0.5, seed=0
    ),
    "priority-adv": ReplayConfig(window=16384, priority="advantage", seed=0),
    "diversity-prompt": ReplayConfig(window=16384, diversity="prompt", seed=0),
    "diversity-emb": ReplayConfig(window=16384, diversity="embedding", seed=0),
}


def grow(store: RolloutStore, target: int, done: int) -> int:
    """Append proxy rollouts until the store holds ``target`` rows."""
    batches = proxy_batches(
        target - done,
        seed=done,
        start_index=done,
        rollouts_per_version=2048,
        mean_completion_tokens=8,
        prompt_tokens=(4, 8),
        batch_rollouts=8192,
        embedding_dim=store.embedding_dim,
    )
    for t in batches:
        store.append(t)
    return target


def time_selection(store: RolloutStore, draws: int, done: int) -> tuple[dict, int]:
    latest = store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py() + 1
    out = {}
    for name, cfg in STRATEGIES.items():
        sel = Selector(store, cfg, run_id=f"bench-{name}")
        t0 = time.perf_counter()
        sel.sample(256, latest)
        cold = time.perf_counter() - t0
        lat = []
        for _ in range(draws):
            t0 = time.perf_counter()
            sel.sample(256, latest)
            lat.append(time.perf_counter() - t0)
        lat.sort()
        # The live case: an actor appended since the last draw, so the buffer is recomputed.
        fresh = []
        for _ in range(3):
            done = grow(store, done + 1024, done)
            t0 = time.perf_counter()
            sel.sample(256, latest)
            fresh.append(time.perf_counter() - t0)
        out[name] = {
            "cold_ms": 1e3 * cold,
            "p50_ms": 1e3 * statistics.median(lat),
            "p95_ms": 1e3 * lat[int(0.95 * (len(lat) - 1))],
            "after_append_ms": 1e3 * statistics.median(fresh),
        }
    return out, done


def bench_loader(work: Path, rollouts: int, batches: int, prefetch: int = 2) -> dict:
    shutil.rmtree(work / "loader", ignore_errors=True)
    store = RolloutStore.open(work / "loader")
    store.append(proxy_batches(rollouts, seed=1, batch_rollouts=1024))
    store.compact()
    store = store.checkout(store.version)
    budget = 65536
    ds = ReplayDataset(
        store,
        ReplayConfig(seed=0),
        prefetch=prefetch,
        max_tokens_per_batch=budget,
        pack=True,
        learner_version=100,
        steps=batches + 1,
        record_usage=False,
    )
    it = iter(ds)
    next(it)  # warm: fragment stats, first scan
    t0 = time.perf_counter()
    tokens, ids = 0, []
    for b in it:
        tokens += b["num_tokens"]
        ids.append(b["rollout_ids"])
    loader_s = time.perf_counter() - t0

    # In-memory baseline: the same rollouts as numpy arrays, the same rows packed.
    table = store.dataset().to_table(
        columns=["rollout_id", "prompt_ids", "completion_ids", "behavior_logprobs"]
    )
    index = {r: i for i, r in enumerate(table["rollout_id"].to_pylist())}
    prompts = [np.asarray(x, np.int32) for x in table["prompt_ids"].to_pylist()]
    comps = [np.asarray(x, np.int32) for x in table["completion_ids"].to_pylist()]
    lps = [np.asarray(x, np.float32) for x in table["behavior_logprobs"].to_pylist()]
    t0 = time.perf_counter()
    base_tokens = 0
    for batch_ids in ids:
        rows = [index[r] for r in batch_ids]
        seqs = [np.concatenate([prompts[i], comps[i]]) for i in rows]
        input_ids = torch.from_numpy(np.concatenate(seqs).astype(np.int64))[None]
        mask = np.concatenate(
            [np.r_[np.zeros(len(prompts[i])), np.ones(len(comps[i]))] for i in rows]
        )
        blp = np.concatenate([np.r_[np.zeros(len(prompts[i]), np.float32), lps[i]] for i in rows])
        pos = np.concatenate([np.arange(len(s)) for s in seqs])
        _ = (torch.from_numpy(mask[1:]), torch.from_numpy(blp[1:]), torch.from_numpy(pos))
        base_tokens += input_ids.shape[1]
    base_s = time.perf_counter() - t0
    assert base_tokens == tokens
    return {
        "tokens": tokens,
        "loader_tok_s": tokens / loader_s,
        "memory_tok_s": tokens / base_s,
        "ratio": (tokens / loader_s) / (tokens / base_s),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--loader-rollouts", type=int, default=8192)
    ap.add_argument("--loader-batches", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_replay_"))
    result: dict = {"selection": {}, "loader": None}

    store = RolloutStore.open(work / "grow", embedding_dim=16)
    done = 0
    for size in sorted(args.sizes):
        t0 = time.perf_counter()
        done = grow(store, size, done)
        print(
            f"store at {size:,} rows ({len(store.dataset().get_fragments())} fragments, "
            f"grown in {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        result["selection"][size], done = time_selection(store, args.draws, done)
    sizes = sorted(result["selection"])
    print(
        "\nselection of 256 from a 16,384-row window, ms: p50 / p95 of repeated draws / "
        "first draw after an append (buffer recomputed) / cold first draw"
    )
    print(f"{'strategy':<18}" + "".join(f"{s:>32,}" for s in sizes) + f"{'ratio':>8}")
    for name in STRATEGIES:
        cells = ""
        for s in sizes:
            r = result["selection"][s][name]
            cells += (
                f"{r['p50_ms']:>8.1f} /{r['p95_ms']:>6.1f} /{r['after_append_ms']:>6.1f} "
                f"/{r['cold_ms']:>6.0f}"
            )
        first, last = result["selection"][sizes[0]][name], result["selection"][sizes[-1]][name]
        print(f"{name:<18}{cells}{last['after_append_ms'] / first['after_append_ms']:>8.2f}")
    print("(ratio: after-append latency, largest store / smallest store)")

    result["loader"] = {}
    for prefetch in (2, 0):
        lo = bench_loader(work, args.loader_rollouts, args.loader_batches, prefetch=prefetch)
        result["loader"][f"prefetch={prefetch}"] = lo
        print(
            f"loader (packed, 64k-token batches, prefetch={prefetch}): "
            f"{lo['loader_tok_s'] / 1e6:.2f} M tokens/s; in-memory baseline "
            f"{lo['memory_tok_s'] / 1e6:.2f} M tokens/s; ratio {lo['ratio']:.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
