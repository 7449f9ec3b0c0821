"""The store against what a user would pick instead, side by side in one run (issue [speed]).

    python tools/bench_peers.py                    # 20k rollouts of each workload (minutes)
    python tools/bench_peers.py --quick            # ~1 minute: 2k rollouts, fewer draws
    python tools/bench_peers.py --workloads table --rollouts 5000 --json out.json

For each generated workload (``tools/peer_workloads.py``: ``table``, ``long``) it prints:

- bytes/token and ingest M tok/s of JSONL, Parquet-zstd (one file), Parquet-zstd per
  append, TorchRL's ``CompressedListStorage`` (its default codec, which on Python < 3.14 is
  zlib, and with zstd-3 functions) and the store, through the store's public ``append``;
- the draw of 512 rows (select within the newest 4,096, staleness <= 16, then fetch the
  token columns) for DuckDB over the per-append Parquet files, TorchRL, and the store:
  cold (``take_rows`` from disk) and through the loader's token cache (warm);
- the decode bound: the selected rows' token bytes compressed with zstd-3, and the time
  zstd takes to decode them here (no I/O, no per-row work: a floor for any compressed store);
- the loader (``ReplayDataset``) in tokens/s against an in-memory list of the same arrays
  collated into the same tensors (same rows, checked equal), padded and packed, in one
  process and with two DataLoader workers;
- the ratios the issue sets as targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rolloutstore import ReplayConfig, RolloutStore, Selector  # noqa: E402
from rolloutstore.replay.collate import TOKEN_COLUMNS  # noqa: E402
from rolloutstore.replay.loader import TokenCache  # noqa: E402
from tools.bench_loader_peers import describe, loader_section  # noqa: E402
from tools.bench_store import du, n_tokens, write_jsonl  # noqa: E402
from tools.peer_workloads import workload_batches  # noqa: E402

WINDOW, STALENESS, DRAW = 4096, 16, 512
TOKENS = ["prompt_ids", "completion_ids", "behavior_logprobs"]


def _median_ms(fn, draws: int, warm: int = 2) -> float:
    for i in range(warm):
        fn(i)
    times = []
    for i in range(draws):
        t0 = time.perf_counter()
        fn(warm + i)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _window(pv: np.ndarray, n: int) -> np.ndarray:
    """Rows of the newest ``WINDOW`` whose policy version is within ``STALENESS`` of the newest."""
    lo = max(0, n - WINDOW)
    cand = np.arange(lo, n)
    return cand[pv[cand] >= pv[:n].max() - STALENESS]


# -- peers ---------------------------------------------------------------------------------
def bench_jsonl(tables, work: Path, tok: int) -> dict:
    path = work / "r.jsonl"
    t0 = time.perf_counter()
    write_jsonl(pa.concat_tables(tables), path, False)
    return {"bytes_per_token": du(path) / tok, "ingest_tok_s": tok / (time.perf_counter() - t0)}


def bench_parquet_one(tables, work: Path, tok: int) -> dict:
    path = work / "r.parquet"
    t0 = time.perf_counter()
    pq.write_table(pa.concat_tables(tables), path, compression="zstd")
    return {"bytes_per_token": du(path) / tok, "ingest_tok_s": tok / (time.perf_counter() - t0)}


def bench_parquet_appends(tables, work: Path, tok: int, draws: int) -> dict:
    """One Parquet-zstd file per append; DuckDB selects the window and reads the tokens."""
    folder = work / "appends"
    folder.mkdir()
    t0 = time.perf_counter()
    start = 0
    for i, t in enumerate(tables):
        seq = pa.array(np.arange(start, start + t.num_rows, dtype=np.int64))
        pq.write_table(t.append_column("seq", seq), folder / f"{i:06d}.parquet", compression="zstd")
        start += t.num_rows
    out = {"bytes_per_token": du(folder) / tok, "ingest_tok_s": tok / (time.perf_counter() - t0)}
    con = duckdb.connect()
    warnings.filterwarnings("ignore", "Arrow output on a DB-API result", UserWarning)
    glob = str(folder / "*.parquet")
    n = start

    def draw(i: int) -> None:
        meta = con.execute(
            "SELECT seq, policy_version FROM read_parquet(?) WHERE seq >= ? ORDER BY seq",
            [glob, max(0, n - WINDOW)],
        ).fetchnumpy()
        pv = meta["policy_version"]
        keep = meta["seq"][pv >= pv.max() - STALENESS]
        pick = np.random.default_rng([0, i]).choice(keep, size=min(DRAW, len(keep)), replace=False)
        con.execute(
            f"SELECT {', '.join(TOKENS)} FROM read_parquet(?) WHERE seq IN (SELECT unnest(?))",
            [glob, pick.tolist()],
        ).to_arrow_table()

    out["draw_ms"] = _median_ms(draw, draws)
    return out


def _zstd_fns(level: int = 3):
    cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

    def compress(t: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(bytearray(cctx.compress(t.numpy().tobytes())), dtype=torch.uint8)

    def decompress(c: torch.Tensor, meta: dict) -> torch.Tensor:
        raw = bytearray(dctx.decompress(c.numpy().tobytes()))
        return torch.frombuffer(raw, dtype=meta["dtype"]).reshape(meta["shape"])

    return compress, decompress


def bench_torchrl(tables, tok: int, draws: int, zstd: bool) -> dict:
    """One TensorDict per rollout (token lists, embedding, numeric fields) in a
    CompressedListStorage; the draw samples the window in numpy and gets the rows."""
    try:
        from tensordict import TensorDict
        from torchrl.data import CompressedListStorage
    except ImportError:
        return {"error": "torchrl not installed (pip install -e '.[dev]')"}
    n_rows = sum(t.num_rows for t in tables)
    kw = {}
    if zstd:
        kw["compression_fn"], kw["decompression_fn"] = _zstd_fns()
    st = CompressedListStorage(max_size=n_rows, **kw)
    pv = np.zeros(n_rows, np.int64)
    t0 = time.perf_counter()
    n = 0
    for t in tables:
        cols = {c: _rows(t[c]) for c in (*TOKENS, "embedding")}
        items = [
            TensorDict(
                {
                    **{c: torch.from_numpy(cols[c][r].copy()) for c in cols},
                    "policy_version": torch.tensor(t["policy_version"][r].as_py()),
                    "reward": torch.tensor(t["reward"][r].as_py(), dtype=torch.float32),
                    "advantage": torch.tensor(t["advantage"][r].as_py(), dtype=torch.float32),
                },
                batch_size=[],
            )
            for r in range(t.num_rows)
        ]
        st.set(list(range(n, n + len(items))), items)
        pv[n : n + len(items)] = t["policy_version"].to_numpy()
        n += len(items)
    out = {"bytes_per_token": st.bytes() / tok, "ingest_tok_s": tok / (time.perf_counter() - t0)}

    def draw(i: int) -> None:
        keep = _window(pv, n)
        pick = np.random.default_rng([0, i]).choice(keep, size=min(DRAW, len(keep)), replace=False)
        st.get(pick.tolist())

    out["draw_ms"] = _median_ms(draw, draws)
    return out


def _rows(col) -> list[np.ndarray]:
    """A list column as one numpy array per row (views of the flat values)."""
    arr = col.combine_chunks()
    values = arr.flatten().to_numpy(zero_copy_only=False)
    if isinstance(arr, pa.FixedSizeListArray):
        return list(values.reshape(len(arr), arr.type.list_size))
    off = arr.offsets.to_numpy()
    off = off - off[0]
    return np.split(values, off[1:-1])


def bench_store(tables, work: Path, tok: int, draws: int) -> tuple[dict, RolloutStore]:
    path = work / "store"
    t0 = time.perf_counter()
    store = RolloutStore.open(path)
    for t in tables:
        store.append(t)
    out = {"bytes_per_token": store.bytes_on_disk() / tok}
    out["ingest_tok_s"] = tok / (time.perf_counter() - t0)
    store = store.checkout(store.version)
    latest = int(store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py())
    cfg = ReplayConfig(window=WINDOW, max_staleness=STALENESS, seed=0)
    sel = Selector(store, cfg, record_usage=False)
    cache = TokenCache(store, max_tokens=10**9)
    picks: list = []

    def select(i: int):
        s = sel.sample(DRAW, latest, learner_step=i)
        picks.append(s)
        return s

    out["select_ms"] = _median_ms(select, draws)
    cols = TOKEN_COLUMNS
    out["draw_ms"] = _median_ms(lambda i: store.take_rows(select(i).row_addresses, cols), draws)
    out["draw_cached_ms"] = _median_ms(lambda i: cache.rows(select(i)), draws)
    out["decode_bound_ms"], out["draw_tokens"] = decode_bound(store, picks[-1])
    return out, store


def decode_bound(store: RolloutStore, sel) -> tuple[float, int]:
    """(ms zstd-3 takes here to decode the selected rows' token bytes, their token count)."""
    rows = store.take_rows(sel.row_addresses, TOKENS)
    blobs = [rows[c].combine_chunks().flatten().to_numpy().tobytes() for c in TOKENS]
    comp = [zstandard.ZstdCompressor(level=3).compress(b) for b in blobs]
    dctx = zstandard.ZstdDecompressor()
    ms = _median_ms(lambda i: [dctx.decompress(c) for c in comp], 20)
    return ms, n_tokens(rows)


# -- report --------------------------------------------------------------------------------
def run_workload(name: str, rollouts: int, draws: int, steps: int, work: Path) -> dict:
    tables = list(workload_batches(name, rollouts, seed=0))
    tok = sum(n_tokens(t) for t in tables)
    print(f"\n== workload {name!r}: {rollouts:,} rollouts, {tok / 1e6:.1f} M tokens", flush=True)
    res: dict = {"tokens": tok, "systems": {}}
    sy = res["systems"]
    sy["JSONL"] = bench_jsonl(tables, work, tok)
    sy["Parquet-zstd, one file"] = bench_parquet_one(tables, work, tok)
    sy["Parquet-zstd per append + DuckDB"] = bench_parquet_appends(tables, work, tok, draws)
    sy["TorchRL CompressedListStorage (default codec)"] = bench_torchrl(tables, tok, draws, False)
    sy["TorchRL CompressedListStorage (zstd-3)"] = bench_torchrl(tables, tok, draws, True)
    sy["rolloutstore"], store = bench_store(tables, work, tok, draws)
    del tables
    res["loader"] = loader_section(store, steps)
    report(res)
    return res


def report(res: dict) -> None:
    print(f"| system | bytes/token | ingest M tok/s | draw {DRAW} (ms) |")
    print("|---|---|---|---|")
    for name, r in res["systems"].items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | |")
            continue
        draw = f"{r['draw_ms']:.1f}" if "draw_ms" in r else "-"
        if "draw_cached_ms" in r:
            draw += f" cold / {r['draw_cached_ms']:.1f} loader cache (select {r['select_ms']:.1f})"
        print(f"| {name} | {r['bytes_per_token']:.2f} | {r['ingest_tok_s'] / 1e6:.2f} | {draw} |")
    s, sy = res["systems"]["rolloutstore"], res["systems"]
    trl = sy["TorchRL CompressedListStorage (default codec)"]
    trl_z = sy["TorchRL CompressedListStorage (zstd-3)"]
    pqz = sy["Parquet-zstd, one file"]
    ratios = {
        "bytes / Parquet-zstd": s["bytes_per_token"] / pqz["bytes_per_token"],
        "ingest / JSONL": s["ingest_tok_s"] / sy["JSONL"]["ingest_tok_s"],
    }
    if "draw_ms" in trl:
        ratios.update(
            {
                "bytes / TorchRL": s["bytes_per_token"] / trl["bytes_per_token"],
                "draw cold / TorchRL": s["draw_ms"] / trl["draw_ms"],
                "draw cold / TorchRL zstd": s["draw_ms"] / trl_z["draw_ms"],
                "draw loader cache / TorchRL": s["draw_cached_ms"] / trl["draw_ms"],
                "draw loader cache / TorchRL zstd": s["draw_cached_ms"] / trl_z["draw_ms"],
            }
        )
    ratios["draw cold / decode bound"] = s["draw_ms"] / s["decode_bound_ms"]
    ratios["draw loader cache / decode bound"] = s["draw_cached_ms"] / s["decode_bound_ms"]
    print(
        f"decode bound: {s['decode_bound_ms']:.2f} ms for the {s['draw_tokens']:,} tokens of "
        "one draw (zstd-3, measured here)"
    )
    for key, lo in res["loader"].items():
        print(f"loader {key}: {describe(lo)}")
        ratios[f"loader / in-memory, {key}"] = lo["ratio"]
    res["ratios"] = ratios
    print("ratios: " + "; ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--workloads", nargs="+", default=["table", "long"])
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--loader-steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="2k rollouts, 5 draws, 100 loader steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rollouts, args.draws, args.loader_steps = 2_000, 5, 100
    print(f"load: {Path('/proc/loadavg').read_text().strip()} ({os.cpu_count()} cores)")
    out = {}
    for name in args.workloads:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_peers_")) / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        out[name] = run_workload(name, args.rollouts, args.draws, args.loader_steps, work)
        if not args.workdir:
            shutil.rmtree(work.parent, ignore_errors=True)
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
