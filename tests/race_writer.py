"""Writer of the duplicate-race tests (tests/rolloutstore/test_keyed_race.py): append the
same N rows with deterministic rollout ids, as an actor and its zombie would.

    python race_writer.py STORE_URI OPTIONS_JSON GO_FILE     # prints "landed refused"
"""

from __future__ import annotations

import json
import os
import sys
import time

from helpers import make_rows

from rolloutstore import RolloutStore
from rolloutstore.errors import ValidationError

N, BATCH = 200, 20  # ids per writer, rows per append


def batches() -> list[list[dict]]:
    rows = make_rows(N, seed=3)
    for i, r in enumerate(rows):
        r["rollout_id"] = f"race-{i:04d}"  # deterministic ids, as actors write them
    return [rows[i : i + BATCH] for i in range(0, N, BATCH)]


def write_all(uri: str, options: dict | None, go: str | None = None) -> tuple[int, int]:
    """Append every batch (after ``go`` exists); (rows landed, appends refused)."""
    store = RolloutStore.open(uri, storage_options=options)
    todo = batches()
    while go is not None and not os.path.exists(go):
        time.sleep(0.01)
    landed = refused = 0
    for b in todo:
        try:
            landed += store.append(b).rows
        except ValidationError as exc:  # the other writer landed these ids first
            assert exc.field == "rollout_id", exc
            refused += 1
    return landed, refused


if __name__ == "__main__":
    landed, refused = write_all(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
    print(landed, refused)
