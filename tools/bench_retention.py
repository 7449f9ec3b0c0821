"""FIFO vs diversity-preserving eviction on a synthetic, skewed store: coverage side by side.

    python tools/bench_retention.py                      # 200k rows, keep 5/10/25/50%
    python tools/bench_retention.py --rows 1000000       # the ~1M-row scale check

The store drifts the way RL buffers do: each policy version draws prompts from a
Zipf popularity (a few prompts dominate) and from a topic focus that moves over
versions, so the newest rows cover few prompts and few embedding regions; per-prompt
difficulty makes correct answers to hard prompts rare. Embeddings are topic centre
+ prompt offset + noise. For each keep size the script prints the coverage
(prompts, embedding clusters, prompts with a correct answer, combined) of what FIFO
keeps and of what ``evict(keep_last=N, preserve_diversity=True)`` keeps, and the
ratios; then it runs one real eviction on the store and checks the rows left.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from rolloutstore import RolloutStore
from rolloutstore.retention.policy import KINDS, RetentionConfig, plan_retention, read_rows

DIM = 64


def skewed_table(rows: int, *, prompts: int, topics: int, versions: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    group = 8
    groups = rows // group
    n = groups * group
    # Skewed topics: a few hold most prompts, the tail topics a handful each.
    topic_of = np.minimum(rng.zipf(1.5, size=prompts) - 1, topics - 1)
    centres = rng.standard_normal((topics, DIM)).astype(np.float32)
    offsets = 0.3 * rng.standard_normal((prompts, DIM)).astype(np.float32)
    p_correct = rng.beta(0.3, 0.7, size=prompts)  # many hard prompts
    version = np.minimum(np.arange(groups) * versions // groups, versions - 1)
    # Per group: a prompt from the Zipf head (70%), or from the topic focus of its version.
    zipf = np.minimum(rng.zipf(1.3, size=groups) - 1, prompts - 1)
    focus = (version * topics // versions + rng.integers(0, 3, size=groups)) % topics
    by_topic = [np.flatnonzero(topic_of == t) for t in range(topics)]
    focused = np.array([rng.choice(by_topic[t]) if len(by_topic[t]) else 0 for t in focus])
    prompt = np.where(rng.random(groups) < 0.7, zipf, focused).repeat(group)
    emb = centres[topic_of[prompt]] + offsets[prompt]
    emb += 0.2 * rng.standard_normal((n, DIM)).astype(np.float32)
    reward = (rng.random(n) < p_correct[prompt]).astype(np.float32)
    t0 = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1e6)
    ones = pa.ListArray.from_arrays(np.arange(n + 1, dtype=np.int32), np.ones(n, np.int32))
    return pa.table(
        {
            "rollout_id": pa.array([f"r{i:09d}" for i in range(n)]),
            "prompt_id": pa.array([f"p{p}" for p in prompt]),
            "group_id": pa.array([f"g{i // group}" for i in range(n)]),
            "sample_index": pa.array(np.arange(n) % group, pa.int32()),
            "policy_version": pa.array(version.repeat(group).astype(np.int64)),
            "created_at": pa.array(t0 + np.arange(n), pa.timestamp("us", tz="UTC")),
            "prompt_ids": pa.ListArray.from_arrays(
                np.arange(n + 1, dtype=np.int32), pa.array(prompt.astype(np.int32))
            ),
            "completion_ids": ones,
            "behavior_logprobs": pa.ListArray.from_arrays(
                np.arange(n + 1, dtype=np.int32), np.full(n, -0.5, np.float32)
            ),
            "reward": pa.array(reward),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), DIM),
        }
    )


def _row(name: str, c) -> str:
    cells = [f"{100 * c.fraction(k):6.1f}%" if c.fraction(k) is not None else "   -" for k in KINDS]
    return f"| {name} | {c.rows} | " + " | ".join(cells) + f" | {c.combined:.3f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--prompts", type=int, default=20_000)
    ap.add_argument("--topics", type=int, default=64)
    ap.add_argument("--versions", type=int, default=50)
    ap.add_argument("--keep", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5])
    ap.add_argument("--reserve", type=float, nargs="+", default=[0.2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="folder for the store (default: a temp dir)")
    a = ap.parse_args()

    root = Path(a.store or tempfile.mkdtemp(prefix="bench_retention_"))
    shutil.rmtree(root / "store", ignore_errors=True)
    store = RolloutStore.open(root / "store", embedding_dim=DIM)
    t0 = time.perf_counter()
    table = skewed_table(
        a.rows, prompts=a.prompts, topics=a.topics, versions=a.versions, seed=a.seed
    )
    store.append(table.to_batches(max_chunksize=100_000))
    print(f"store: {store.count()} rows, written in {time.perf_counter() - t0:.1f}s")

    t0 = time.perf_counter()
    rows = read_rows(store.dataset())
    print(f"read scalar + embedding columns: {time.perf_counter() - t0:.1f}s\n")
    print("| policy | rows kept | prompts | clusters | correct | combined |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for frac in a.keep:
        keep = int(frac * rows.num_rows)
        for reserve in a.reserve:
            t0 = time.perf_counter()
            plan = plan_retention(rows, keep, RetentionConfig(reserve=reserve, seed=a.seed))
            dt = time.perf_counter() - t0
            r = plan.report
            if reserve == a.reserve[0]:
                print(_row(f"FIFO, keep {frac:.0%}", r.fifo))
            print(_row(f"diverse (reserve {reserve:.0%}), keep {frac:.0%}", r.kept))
            ratio = [(r.kept.fraction(k) or 0) / (r.fifo.fraction(k) or 1) for k in KINDS] + [
                r.kept.combined / r.fifo.combined
            ]
            ratios.append((frac, reserve, ratio, dt))
    print("\ncoverage ratio diverse / FIFO (prompts, clusters, correct, combined), plan time:")
    for frac, reserve, ratio, dt in ratios:
        cells = ", ".join(f"{x:.2f}x" for x in ratio)
        print(f"  keep {frac:.0%}, reserve {reserve:.0%}: {cells}  ({dt:.1f}s)")

    keep = int(a.keep[0] * rows.num_rows)
    t0 = time.perf_counter()
    res = store.evict(keep_last=keep, preserve_diversity=RetentionConfig(reserve=a.reserve[0]))
    dt = time.perf_counter() - t0
    assert res.rows_left == keep == store.count(), (res, keep)
    print(
        f"\nreal evict(keep_last={keep}, preserve_diversity=True): {res.rows_deleted} rows "
        f"deleted in one commit (version {res.version}), {dt:.1f}s end to end"
    )
    if a.store is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
