"""Storage benchmark: the store against JSONL, JSONL.zst and Parquet, side by side in one run.

    python tools/bench_store.py                       # 20k proxy rollouts + 1M-row take test
    python tools/bench_store.py --rollouts 5000 --take-rows 100000   # quick

For each format it prints bytes/token, ingest (write) tokens/s, full-scan decode
tokens/s (token ids + log-probs into numpy) and the latency of a random take of
512 rollouts, then the ratio of each to the store. A second section compares the
encodings considered for the token columns (Lance default, Lance zstd+byte-stream
split = our default, per-row zstd blobs with byte shuffling, uncompressed).
Proxy data: Zipf(1.2) ids over a 151k vocabulary, log-prob mixture, lognormal
lengths around 512, groups of 8 (rolloutstore/io/proxy.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from rolloutstore import RolloutStore
from rolloutstore.io.proxy import proxy_batches, proxy_table

TOKEN_COLS = ["prompt_ids", "completion_ids", "behavior_logprobs"]


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def n_tokens(t: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(t["prompt_ids"])).as_py()) + int(
        pc.sum(pc.list_value_length(t["completion_ids"])).as_py()
    )


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_arrow(t: pa.Table) -> None:
    # What a loader needs: flat numpy token ids and log-probs plus offsets.
    for c in TOKEN_COLS:
        arr = t[c].combine_chunks()
        arr.values.to_numpy(zero_copy_only=False)
        arr.offsets.to_numpy()


# -- formats -----------------------------------------------------------------------------
def _json_rows(table: pa.Table):
    cols = [c for c in table.column_names if c != "embedding"] + ["embedding"]
    for r in table.select(cols).to_pylist():
        yield json.dumps(r, default=str) + "\n"


def write_jsonl(table, path: Path, zst: bool) -> None:
    if zst:
        with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as w:
            for line in _json_rows(table):
                w.write(line.encode())
    else:
        with open(path, "w") as f:
            f.writelines(_json_rows(table))


def read_jsonl(path: Path, zst: bool) -> None:
    import io

    if zst:
        raw = open(path, "rb")  # noqa: SIM115
        f = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw))
    else:
        f = open(path)  # noqa: SIM115
    with f:
        ids, lps = [], []
        for line in f:
            r = json.loads(line)
            ids.append(np.asarray(r["prompt_ids"] + r["completion_ids"], np.int32))
            lps.append(np.asarray(r["behavior_logprobs"], np.float32))
        np.concatenate(ids), np.concatenate(lps)


def take_jsonl(path: Path, zst: bool, idx: np.ndarray) -> None:
    # No index: a take must scan the file up to the last wanted row.
    import io

    want = set(idx.tolist())
    last = int(idx.max())
    raw = open(path, "rb")  # noqa: SIM115
    f = (
        io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw))
        if zst
        else io.TextIOWrapper(raw)
    )
    with f:
        for i, line in enumerate(f):
            if i in want:
                json.loads(line)
            if i >= last:
                break


def take_parquet(path: Path, idx: np.ndarray) -> None:
    pf = pq.ParquetFile(path)
    bounds = np.cumsum([pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
    groups = sorted(set(np.searchsorted(bounds, idx, side="right").tolist()))
    t = pf.read_row_groups(groups, columns=TOKEN_COLS)
    starts = np.concatenate([[0], bounds])[groups]
    local = np.concatenate([[0], np.cumsum([pf.metadata.row_group(g).num_rows for g in groups])])
    pos = []
    for i in idx:
        g = int(np.searchsorted(bounds, i, side="right"))
        k = groups.index(g)
        pos.append(local[k] + (i - starts[k]))
    t.take(pa.array(pos))


def bench_formats(table: pa.Table, work: Path, take_repeat: int) -> list[dict]:
    tok = n_tokens(table)
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(table.num_rows, size=min(512, table.num_rows), replace=False))
    out = []

    def add(name, path, write, read, take):
        w = timed(write)
        r = timed(read)
        tk = statistics.median([timed(take) for _ in range(take_repeat)])
        out.append(
            {
                "format": name,
                "bytes_per_token": du(path) / tok,
                "ingest_tok_s": tok / w,
                "decode_tok_s": tok / r,
                "take512_ms": tk * 1e3,
            }
        )

    p = work / "r.jsonl"
    add(
        "JSONL",
        p,
        lambda: write_jsonl(table, p, False),
        lambda: read_jsonl(p, False),
        lambda: take_jsonl(p, False, idx),
    )
    pz = work / "r.jsonl.zst"
    add(
        "JSONL.zst",
        pz,
        lambda: write_jsonl(table, pz, True),
        lambda: read_jsonl(pz, True),
        lambda: take_jsonl(pz, True, idx),
    )
    for comp in ("snappy", "zstd"):
        pp = work / f"r.{comp}.parquet"
        add(
            f"Parquet {comp}",
            pp,
            lambda pp=pp, comp=comp: pq.write_table(table, pp, compression=comp),
            lambda pp=pp: decode_arrow(pq.read_table(pp, columns=TOKEN_COLS)),
            lambda pp=pp: take_parquet(pp, idx),
        )
    sp = work / "store"

    def write_store():
        shutil.rmtree(sp, ignore_errors=True)
        RolloutStore.open(sp).append(table)

    store_holder = {}

    def read_store():
        s = store_holder.setdefault("s", RolloutStore.open(sp, create=False))
        decode_arrow(s.dataset().to_table(columns=TOKEN_COLS))

    def take_store():
        store_holder["s"].take(idx, columns=TOKEN_COLS)

    add("rolloutstore", sp / "rollouts.lance", write_store, read_store, take_store)
    return out


# -- encodings ---------------------------------------------------------------------------
def bench_encodings(table: pa.Table, work: Path) -> list[dict]:
    tok = n_tokens(table)
    sub = table.select(TOKEN_COLS)
    out = []

    def with_child_meta(meta: dict) -> pa.Table:
        fields = [
            pa.field(f.name, pa.list_(f.type.value_field.with_metadata(meta))) for f in sub.schema
        ]
        return sub.cast(pa.schema(fields))

    cases = {
        "Lance default": sub,
        "Lance zstd-3 + byte-stream-split (default)": with_child_meta(
            {
                "lance-encoding:compression": "zstd",
                "lance-encoding:compression-level": "3",
                "lance-encoding:bss": "on",
            }
        ),
        "Lance none": with_child_meta({"lance-encoding:compression": "none"}),
    }
    for name, t in cases.items():
        p = work / f"enc-{len(out)}.lance"
        w = timed(lambda t=t, p=p: lance.write_dataset(t, p, mode="overwrite"))
        ds = lance.dataset(p)
        r = timed(lambda ds=ds: decode_arrow(ds.to_table()), repeat=2)
        out.append(
            {
                "encoding": name,
                "bytes_per_token": du(p) / tok,
                "write_tok_s": tok / w,
                "decode_tok_s": tok / r,
            }
        )

    # zstd-framed per-row blobs with byte shuffling (what a hand-rolled codec would store).
    cz, dz = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def encode():
        cols = {}
        for c in TOKEN_COLS:
            arr = sub[c].combine_chunks()
            vals, off = arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy()
            cols[c] = pa.array(
                [
                    cz.compress(
                        np.ascontiguousarray(vals[a:b].view(np.uint8).reshape(-1, 4).T).tobytes()
                    )
                    for a, b in zip(off[:-1], off[1:])
                ],
                pa.binary(),
            )
        return pa.table(cols)

    holder = {}
    w = timed(lambda: holder.setdefault("t", encode()))
    p = work / "enc-blob.lance"
    lance.write_dataset(holder["t"], p, mode="overwrite")

    def decode():
        t = lance.dataset(p).to_table()
        for c, dt in zip(TOKEN_COLS, (np.int32, np.int32, np.float32)):
            for b in t[c].to_pylist():
                raw = np.frombuffer(dz.decompress(b), np.uint8)
                raw.reshape(4, -1).T.copy().view(dt)

    r = timed(decode)
    out.append(
        {
            "encoding": "per-row zstd-3 blobs, byte-shuffled",
            "bytes_per_token": du(p) / tok,
            "write_tok_s": tok / w,
            "decode_tok_s": tok / r,
        }
    )
    return out


def bench_take_at_scale(rows: int, work: Path, repeat: int = 20) -> dict:
    """Random take of 512 rollouts from a store of ``rows`` rows (short completions)."""
    p = work / "big"
    store = RolloutStore.open(p)
    t0 = time.perf_counter()
    store.append(
        proxy_batches(
            rows, seed=1, mean_completion_tokens=64, prompt_tokens=(16, 64), batch_rollouts=65536
        )
    )
    build = time.perf_counter() - t0
    store.compact()
    rng = np.random.default_rng(0)
    lat = []
    for _ in range(repeat):
        idx = np.sort(rng.choice(rows, size=512, replace=False))
        t0 = time.perf_counter()
        store.take(idx, columns=TOKEN_COLS)
        lat.append(time.perf_counter() - t0)
    return {
        "rows": rows,
        "build_s": build,
        "take512_p50_ms": 1e3 * statistics.median(lat),
        "take512_p95_ms": 1e3 * sorted(lat)[int(0.95 * (len(lat) - 1))],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--take-rows", type=int, default=1_000_000, help="0 skips the large take test")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_store_"))
    work.mkdir(parents=True, exist_ok=True)
    table = proxy_table(args.rollouts, seed=0)
    tok = n_tokens(table)
    print(f"proxy data: {table.num_rows:,} rollouts, {tok:,} tokens ({os.cpu_count()} cores)\n")

    formats = bench_formats(table, work, take_repeat=5)
    ref = next(f for f in formats if f["format"] == "rolloutstore")
    print(
        f"{'format':<14} {'B/token':>8} {'ingest Mtok/s':>14} {'decode Mtok/s':>14} "
        f"{'take512 ms':>11} | {'size x':>7} {'ingest x':>9} {'decode x':>9} {'take x':>7}"
    )
    for f in formats:
        print(
            f"{f['format']:<14} {f['bytes_per_token']:>8.2f} {f['ingest_tok_s'] / 1e6:>14.2f} "
            f"{f['decode_tok_s'] / 1e6:>14.2f} {f['take512_ms']:>11.1f} | "
            f"{f['bytes_per_token'] / ref['bytes_per_token']:>7.2f} "
            f"{ref['ingest_tok_s'] / f['ingest_tok_s']:>9.2f} "
            f"{ref['decode_tok_s'] / f['decode_tok_s']:>9.2f} "
            f"{f['take512_ms'] / ref['take512_ms']:>7.1f}"
        )
    print("(x columns: how many times the store is smaller / faster than the format)\n")

    encodings = bench_encodings(table, work)
    print(
        f"{'token-column encoding':<44} {'B/token':>8} {'write Mtok/s':>13} {'decode Mtok/s':>14}"
    )
    for e in encodings:
        print(
            f"{e['encoding']:<44} {e['bytes_per_token']:>8.2f} {e['write_tok_s'] / 1e6:>13.2f} "
            f"{e['decode_tok_s'] / 1e6:>14.2f}"
        )
    result = {"rollouts": table.num_rows, "tokens": tok, "formats": formats, "encodings": encodings}
    if args.take_rows:
        big = bench_take_at_scale(args.take_rows, work)
        result["take_at_scale"] = big
        print(
            f"\nrandom take of 512 from a {big['rows']:,}-row store: p50 {big['take512_p50_ms']:.1f} ms, "
            f"p95 {big['take512_p95_ms']:.1f} ms (store built in {big['build_s']:.0f} s)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
