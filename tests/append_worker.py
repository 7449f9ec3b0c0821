"""Subprocess for the atomicity tests: append numbered batches of known sizes to a store.

    python append_worker.py STORE TAG N_BATCHES
Each batch i has batch_size(i) rows whose ``task`` is "TAG:i:size".
"""

from __future__ import annotations

import sys

from helpers import make_rows

from rolloutstore import RolloutStore


def batch_size(i: int) -> int:
    return 5 + (i * 7) % 23


def main() -> None:
    path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = RolloutStore.open(path)
    for i in range(n):
        size = batch_size(i)
        rows = make_rows(size, seed=i, run_id=tag)
        for r in rows:
            r["task"] = f"{tag}:{i}:{size}"
        store.append(rows)
        print(i, flush=True)


if __name__ == "__main__":
    main()
