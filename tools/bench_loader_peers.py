"""The loader half of ``tools/bench_peers.py``: ``ReplayDataset`` against an in-memory list.

The baseline is what a user holding the rollouts in memory would write: one numpy array
per rollout and field, and a collate that copies each chosen row into the padded (or
packed) tensors. It collates the very rows the loader drew (same order) into the same
keys, and the first batch of each pair is checked equal, so both sides do the same work
but the selection, the store reads and the caching. With workers, both sides run under a
``DataLoader`` with the same number of spawned workers.

Run alone, it prints where one loader batch's time goes (selection, the take from the token
cache, collate; collate again with every batch kept, as the comparison keeps them, so the
first touch of fresh output memory shows), then the loader vs in-memory ratios::

    python tools/bench_loader_peers.py                        # 6,000 `table` rollouts, packed
    python tools/bench_loader_peers.py --workload long --padded --rollouts 3000
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


def _timed(it, steps: int, warm: int) -> tuple[float, int, list]:
    """(seconds, tokens, batches) for ``steps`` batches after ``warm`` warm-up ones (one per
    worker: each spawned worker's start-up is not timed)."""
    got = [next(it) for _ in range(warm)]
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        b = next(it)
        tokens += b["num_tokens"]
        got.append(b)
    return time.perf_counter() - t0, tokens, got


def one_case(store: RolloutStore, steps: int, pack: bool, workers: int) -> dict:
    latest = int(store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py())
    ds = ReplayDataset(
        store,
        ReplayConfig(window=WINDOW, max_staleness=STALENESS, seed=0),
        batch_size=BATCH,
        pack=pack,
        learner_version=latest,
        steps=steps + max(workers, 1),
        record_usage=False,
    )
    it = iter(_loader(ds, workers))
    secs, tokens, got = _timed(it, steps, max(workers, 1))
    del it
    ids = {r for b in got for r in b["rollout_ids"]}
    (prompts, comps, lps), index = _arrays(store, ids)
    batches = [[index[r] for r in b["rollout_ids"]] for b in got]
    base = _loader(MemoryBatches(prompts, comps, lps, batches, pack), workers)
    m_secs, m_tokens, m_got = _timed(iter(base), steps, max(workers, 1))
    assert m_tokens == tokens, (m_tokens, tokens)
    for k in CHECKED:
        assert torch.equal(got[0][k], m_got[0][k]), f"loader and baseline differ in {k}"
    return {
        "tokens": tokens,
        "loader_tok_s": tokens / secs,
        "memory_tok_s": tokens / m_secs,
        "ratio": (tokens / secs) / (tokens / m_secs),
    }


def _loader(ds, workers: int):
    if workers == 0:
        return ds
    return DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="spawn")


def loader_section(store: RolloutStore, steps: int) -> dict:
    out = {}
    for pack in (False, True):
        for workers in (0, 2):
            key = f"{'packed' if pack else 'padded'}, {workers or 'no'} workers"
            out[key] = one_case(store, steps, pack, workers)
            print(f"  loader {key}: ratio {out[key]['ratio']:.2f}", flush=True)
    return out


def loader_phases(store: RolloutStore, steps: int, pack: bool) -> dict[str, float]:
    """Milliseconds per batch of each step of a loader batch, the buffer already cached:
    selection, the take from the token cache, collate (batches dropped), and collate with
    every batch kept alive (fresh output memory each time, as :func:`one_case` keeps them)."""
    from rolloutstore.replay.collate import collate
    from rolloutstore.replay.loader import TokenCache
    from rolloutstore.replay.selector import Selector

    latest = int(store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py())
    sel = Selector(store, ReplayConfig(window=WINDOW, max_staleness=STALENESS, seed=0),
                   record_usage=False)  # fmt: skip
    cache = TokenCache(store, 10**9)
    cache.rows(sel.sample(BATCH, latest, learner_step=0))  # fills the cache with the buffer
    total = dict.fromkeys(("select", "take", "collate", "collate, batches kept"), 0.0)
    kept = []
    for i in range(1, 2 * steps + 1):
        keep = i > steps
        t0 = time.perf_counter()
        s = sel.sample(BATCH, latest, learner_step=i)
        t1 = time.perf_counter()
        idx = np.arange(len(s))
        rows = cache.rows(s, idx)
        t2 = time.perf_counter()
        batch = collate(rows, s, idx, pack=pack)
        t3 = time.perf_counter()
        if keep:
            kept.append(batch)
        else:
            total["select"] += t1 - t0
            total["take"] += t2 - t1
        total["collate, batches kept" if keep else "collate"] += t3 - t2
    return {k: v / steps * 1000 for k, v in total.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["table", "long"], default="table")
    ap.add_argument("--rollouts", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--padded", action="store_true", help="padded batches (default: packed)")
    args = ap.parse_args(argv)
    from tools.peer_workloads import workload_batches

    with tempfile.TemporaryDirectory() as work:
        store = RolloutStore.open(Path(work) / "store")
        for t in workload_batches(args.workload, args.rollouts, seed=0):
            store.append(t)
        store = store.checkout(store.version)
        pack = not args.padded
        phases = loader_phases(store, args.steps, pack)
        print(f"{args.workload}, {args.rollouts:,} rollouts, {'packed' if pack else 'padded'} "
              f"batches of {BATCH}: ms per batch")  # fmt: skip
        for k, v in phases.items():
            print(f"  {k:<24} {v:6.2f}")
        r = one_case(store, args.steps, pack, 0)
        print(f"loader {r['loader_tok_s'] / 1e6:.1f} M tok/s vs in-memory list "
              f"{r['memory_tok_s'] / 1e6:.1f} M tok/s: {r['ratio']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
