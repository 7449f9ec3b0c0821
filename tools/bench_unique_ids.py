"""Cost of the rollout_id uniqueness check per append: full scan vs BTREE index, side by side.

    python tools/bench_unique_ids.py                  # 200k stored rows in 100 fragments
    python tools/bench_unique_ids.py --rows 1000000
    python tools/bench_unique_ids.py --keyed          # keyed insert vs check-then-append

Prints, for appends of 64 and 4096 rows that name their rollout ids: the append with
the check (index lookup + unindexed tail, what ``RolloutStore.append`` does), the
append of rows without ids (no check needed: the store generates UUIDv7), the
lookup alone through the index, and the lookup by a full-scan filter; then ratios.

``--keyed``: appends that name their ids, through the keyed insert (Lance merge_insert on
rollout_id, what ``RolloutStore.append`` does; atomic against concurrent writers of one id)
vs the check-then-append it replaced (``RolloutLog.KEYED_INSERT = False``), alternated on
the same store, in rows per second; plus appends without ids (plain append) for scale.
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


def keyed(store: RolloutStore, repeat: int) -> None:
    """Keyed insert vs check-then-append, alternated on one store (fresh ids each time)."""
    seed = 1000
    for n in (64, 1024, 4096):
        times: dict[str, list[float]] = {"keyed": [], "checked": [], "no ids": []}
        for _ in range(repeat):
            for name in times:
                seed += 1
                batch = rows(n, seed, ids=name != "no ids")
                type(store).KEYED_INSERT = name != "checked"
                t0 = time.perf_counter()
                store.append(batch)
                times[name].append(time.perf_counter() - t0)
        type(store).KEYED_INSERT = True
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(
            f"{n:5d}-row append, median of {repeat}: keyed {med['keyed'] * 1e3:7.1f} ms "
            f"({n / med['keyed']:8.0f} rows/s) | check-then-append {med['checked'] * 1e3:7.1f} ms "
            f"({n / med['checked']:8.0f} rows/s) | no ids {med['no ids'] * 1e3:7.1f} ms | "
            f"keyed/checked time {med['keyed'] / med['checked']:4.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--keyed", action="store_true", help="keyed insert vs check-then-append")
    ap.add_argument("--repeat", type=int, default=7, help="--keyed: appends per mode and size")
    a = ap.parse_args()
    root = tempfile.mkdtemp()
    try:
        store = RolloutStore.open(f"{root}/store")
        per = max(1, a.rows // 100)
        for i in range(100):
            store.append(rows(per, i, ids=False))
        ds = store.dataset()
        print(f"store: {ds.count_rows()} rows, {len(ds.get_fragments())} fragments")
        if a.keyed:
            keyed(store, a.repeat)
            return
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
