"""Cost of the rollout_id uniqueness check per append: full scan vs BTREE index, side by side.

    python tools/bench_unique_ids.py                  # 200k stored rows in 100 fragments
    python tools/bench_unique_ids.py --rows 1000000

Prints, for appends of 64 and 4096 rows that name their rollout ids: the append with
the check (index lookup + unindexed tail, what ``RolloutStore.append`` does), the
append of rows without ids (no check needed: the store generates UUIDv7), the
lookup alone through the index, and the lookup by a full-scan filter; then ratios.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np
import pyarrow.compute as pc

from rolloutstore import RolloutStore
from rolloutstore.schema.ids import uuid7_strings
from rolloutstore.store.unique import ID_INDEX


def rows(n: int, seed: int, ids: bool) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i, rid in enumerate(uuid7_strings(n)):
        c = int(rng.integers(1, 40))
        r = {
            "policy_version": i,
            "prompt_ids": rng.integers(0, 1000, size=8).tolist(),
            "completion_ids": rng.integers(0, 1000, size=c).tolist(),
            "behavior_logprobs": (-rng.exponential(1.0, size=c)).tolist(),
        }
        if ids:
            r["rollout_id"] = rid
        out.append(r)
    return out


def timed(f, repeat: int = 5) -> float:
    f()
    start = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - start) / repeat * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    a = ap.parse_args()
    root = tempfile.mkdtemp()
    try:
        store = RolloutStore.open(f"{root}/store")
        per = max(1, a.rows // 100)
        for i in range(100):
            store.append(rows(per, i, ids=False))
        ds = store.dataset()
        print(f"store: {ds.count_rows()} rows, {len(ds.get_fragments())} fragments")
        for n in (64, 4096):
            ids = uuid7_strings(n)
            expr = pc.field("rollout_id").isin(ids)

            def scan(ds=ds, expr=expr):
                return ds.to_table(columns=["rollout_id"], filter=expr)

            t_scan = timed(scan)
            t_plain = timed(lambda n=n: store.append(rows(n, 1, ids=False)), 2)
            t_checked = timed(lambda n=n: store.append(rows(n, 2, ids=True)), 2)
            ds2 = store.dataset()
            if not any(i.name == ID_INDEX for i in ds2.describe_indices()):
                ds2.create_scalar_index("rollout_id", "BTREE", name=ID_INDEX)
                ds2 = store.dataset()

            def lookup(ds2=ds2, expr=expr):
                return ds2.to_table(columns=["rollout_id"], filter=expr)

            t_index = timed(lookup)
            print(
                f"{n:5d}-row append: no ids {t_plain:7.1f} ms | with ids (checked) {t_checked:7.1f} ms"
                f" | lookup: index {t_index:6.1f} ms, full scan {t_scan:6.1f} ms | "
                f"scan/index {t_scan / t_index:5.1f}x, check/append {t_index / t_plain:5.2f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
