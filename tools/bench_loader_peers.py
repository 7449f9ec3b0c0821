"""The loader half of ``tools/bench_peers.py``: ``ReplayDataset`` against an in-memory list.

The baseline is what a user holding the rollouts in memory would write: one numpy array
per rollout and field, and a collate that copies each chosen row into the padded (or
packed) tensors. It collates the very rows the loader drew (same order) into the same
keys, and the first batch of each pair is checked equal, so both sides do the same work
but the selection, the store reads and the caching. With workers, both sides run under a
``DataLoader`` with the same number of spawned workers.

Both sides drop each batch once counted, as a training loop does; the "batches kept" rows
hold them all (each batch then pays the first touch of fresh output memory, on both sides).
Without workers the ratio is also given by this process's CPU time, which a busy machine
disturbs far less than the wall clock.

Run alone, it prints where one loader batch's CPU time goes (selection, the hand-over of the
rows from the token cache, collate; collate again with every batch kept), then the loader vs
in-memory ratios, batches dropped and kept::

    python tools/bench_loader_peers.py                        # 6,000 `table` rollouts, packed
    python tools/bench_loader_peers.py --workload long --padded --rollouts 3000
    # the same ratios on an older commit's loader (docs/benchmarks.md's "before" column):
    git worktree add /tmp/old 3f2143a
    PYTHONPATH=/tmp/old python tools/bench_loader_peers.py --rollouts 2000 --ratios-only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore

WINDOW, STALENESS, BATCH = 4096, 16, 64
CHECKED = ("input_ids", "attention_mask", "position_ids", "loss_mask", "behavior_logprobs")


def memory_collate(prompts, comps, lps, rows, pack: bool) -> dict[str, torch.Tensor]:
    """The straightforward collate: per-row slice copies into preallocated arrays."""
    p_len = np.array([len(prompts[i]) for i in rows])
    lengths = p_len + np.array([len(comps[i]) for i in rows])
    n_rows, width = (1, int(lengths.sum())) if pack else (len(rows), int(lengths.max()))
    ids = np.zeros((n_rows, width), np.int64)
    pos = np.zeros((n_rows, width), np.int64)
    mask = np.zeros((n_rows, width - 1), np.float32)
    blp = np.zeros((n_rows, width - 1), np.float32)
    at = 0
    for k, i in enumerate(rows):
        r, s = (0, at) if pack else (k, 0)
        p, n = p_len[k], lengths[k]
        ids[r, s : s + p] = prompts[i]
        ids[r, s + p : s + n] = comps[i]
        pos[r, s : s + n] = np.arange(n)
        mask[r, s + p - 1 : s + n - 1] = 1.0
        blp[r, s + p - 1 : s + n - 1] = lps[i]
        at += n
    if pack:
        attn = np.ones((1, width), np.int64)
    else:
        attn = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "position_ids": torch.from_numpy(pos),
        "loss_mask": torch.from_numpy(mask),
        "behavior_logprobs": torch.from_numpy(blp),
        "num_tokens": int(lengths.sum()),
    }


class MemoryBatches(IterableDataset):
    """The baseline under a DataLoader: batch ``k`` of ``batches`` built by worker ``k % W``."""

    def __init__(self, prompts, comps, lps, batches: list[list[int]], pack: bool):
        self.prompts, self.comps, self.lps = prompts, comps, lps
        self.batches, self.pack = batches, pack

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for k, rows in enumerate(self.batches):
            if k % nw == wid:
                yield memory_collate(self.prompts, self.comps, self.lps, rows, self.pack)


def _arrays(store: RolloutStore, ids: set[str]):
    """The drawn rollouts as per-row numpy arrays, and each rollout id's position."""
    t = store.dataset().to_table(
        columns=["rollout_id", "prompt_ids", "completion_ids", "behavior_logprobs"]
    )
    keep = np.isin(np.asarray(t["rollout_id"].to_pylist(), dtype=object), list(ids))
    t = t.filter(keep)
    out = []
    for c in ("prompt_ids", "completion_ids", "behavior_logprobs"):
        arr = t[c].combine_chunks()
        off = arr.offsets.to_numpy()
        vals = arr.flatten().to_numpy(zero_copy_only=False)
        out.append([vals[off[i] - off[0] : off[i + 1] - off[0]].copy() for i in range(len(arr))])
    index = {r: i for i, r in enumerate(t["rollout_id"].to_pylist())}
    return out, index


def _timed(it, steps: int, warm: int, keep: bool) -> dict:
    """Time ``steps`` batches after ``warm`` warm-up ones (one per worker: each spawned
    worker's start-up is not timed): wall and this process's CPU seconds (every thread; a
    worker's CPU is not counted), tokens, each batch's rollout ids, and the first batch.
    ``keep``: hold every batch until the end (fresh output memory for each, whose first touch
    the batch pays) instead of dropping it as a training loop does."""
    first = [next(it) for _ in range(warm)]
    ids = [b.get("rollout_ids") for b in first]
    kept = []
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for _ in range(steps):
        b = next(it)
        tokens += b["num_tokens"]
        ids.append(b.get("rollout_ids"))
        if keep:
            kept.append(b)
        del b
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "tokens": tokens, "ids": ids, "first": first[0]}


def one_case(store: RolloutStore, steps: int, pack: bool, workers: int, keep: bool = False):
    """The loader against the in-memory list on the same batches: tokens/s and their ratio,
    by wall clock and (no workers) by this process's CPU time, which a busy machine disturbs
    far less than the wall clock."""
    latest = int(store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py())
    warm = max(workers, 1)
    ds = ReplayDataset(
        store,
        ReplayConfig(window=WINDOW, max_staleness=STALENESS, seed=0),
        batch_size=BATCH,
        pack=pack,
        learner_version=latest,
        steps=steps + warm,
        record_usage=False,
    )
    it = iter(_loader(ds, workers))
    lo = _timed(it, steps, warm, keep)
    del it
    (prompts, comps, lps), index = _arrays(store, {r for b in lo["ids"] for r in b})
    batches = [[index[r] for r in b] for b in lo["ids"]]
    base = _loader(MemoryBatches(prompts, comps, lps, batches, pack), workers)
    mem = _timed(iter(base), steps, warm, keep)
    assert mem["tokens"] == lo["tokens"], (mem["tokens"], lo["tokens"])
    for k in CHECKED:
        assert torch.equal(lo["first"][k], mem["first"][k]), f"loader and baseline differ in {k}"
    tokens = lo["tokens"]
    out = {
        "tokens": tokens,
        "loader_tok_s": tokens / lo["wall"],
        "memory_tok_s": tokens / mem["wall"],
        "ratio": mem["wall"] / lo["wall"],
    }
    if workers == 0:
        out["cpu_ratio"] = mem["cpu"] / lo["cpu"]
    return out


def describe(r: dict) -> str:
    cpu = f"; by CPU time {r['cpu_ratio']:.2f}" if "cpu_ratio" in r else ""
    return (
        f"{r['loader_tok_s'] / 1e6:.2f} M tok/s vs in-memory list {r['memory_tok_s'] / 1e6:.2f}"
        f" M tok/s: {r['ratio']:.2f}{cpu}"
    )


def _loader(ds, workers: int):
    if workers == 0:
        return ds
    return DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="spawn")


def loader_section(store: RolloutStore, steps: int) -> dict:
    """Padded and packed, no workers and 2: batches dropped as a training loop drops them;
    with no workers also kept (each batch's first touch of fresh memory then shows)."""
    out = {}
    for pack in (False, True):
        for workers, keep in ((0, False), (0, True), (2, False)):
            key = f"{'packed' if pack else 'padded'}, {workers or 'no'} workers"
            key += ", batches kept" if keep else ""
            out[key] = one_case(store, steps, pack, workers, keep)
            print(f"  loader {key}: {describe(out[key])}", flush=True)
    return out


def loader_phases(store: RolloutStore, steps: int, pack: bool) -> dict[str, float]:
    """CPU milliseconds per batch of each step of a loader batch, the buffer already cached:
    selection, the rows' hand-over from the token cache (offsets into it, no copy), collate
    (batches dropped), and collate with every batch kept alive (fresh output memory each)."""
    from rolloutstore.replay.collate import collate
    from rolloutstore.replay.loader import TokenCache
    from rolloutstore.replay.selector import Selector

    latest = int(store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py())
    sel = Selector(store, ReplayConfig(window=WINDOW, max_staleness=STALENESS, seed=0),
                   record_usage=False)  # fmt: skip
    cache = TokenCache(store, 10**9)
    cache.token_rows(sel.sample(BATCH, latest, learner_step=0))  # caches the whole buffer
    total = dict.fromkeys(("select", "hand-over", "collate", "collate, batches kept"), 0.0)
    kept = []
    for i in range(1, 2 * steps + 1):
        keep = i > steps
        t0 = time.thread_time()
        s = sel.sample(BATCH, latest, learner_step=i)
        t1 = time.thread_time()
        idx = np.arange(len(s))
        rows = cache.token_rows(s, idx)
        t2 = time.thread_time()
        batch = collate(rows, s, idx, pack=pack)
        t3 = time.thread_time()
        if keep:
            kept.append(batch)
        else:
            total["select"] += t1 - t0
            total["hand-over"] += t2 - t1
        total["collate, batches kept" if keep else "collate"] += t3 - t2
    return {k: v / steps * 1000 for k, v in total.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["table", "long"], default="table")
    ap.add_argument("--rollouts", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--padded", action="store_true", help="padded batches (default: packed)")
    ap.add_argument(
        "--ratios-only", action="store_true",
        help="skip the phase breakdown (it needs this checkout's loader; the ratios run "
        "against an older one too: PYTHONPATH=<its worktree>)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    from tools.peer_workloads import workload_batches

    with tempfile.TemporaryDirectory() as work:
        store = RolloutStore.open(Path(work) / "store")
        for t in workload_batches(args.workload, args.rollouts, seed=0):
            store.append(t)
        store = store.checkout(store.version)
        pack = not args.padded
        print(f"{args.workload}, {args.rollouts:,} rollouts, {'packed' if pack else 'padded'} "
              f"batches of {BATCH}")  # fmt: skip
        if not args.ratios_only:
            print("CPU ms per batch:")
            for k, v in loader_phases(store, args.steps, pack).items():
                print(f"  {k:<24} {v:6.2f}")
        for keep in (False, True):
            r = one_case(store, args.steps, pack, 0, keep)
            print(f"loader, batches {'kept' if keep else 'dropped'}: {describe(r)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
