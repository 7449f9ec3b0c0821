"""Fuzzing append and ingest with hostile rows and corrupted files (hypothesis).

Runs 100 append cases and 40 ingest cases by default (FUZZ_EXAMPLES scales both).
Property: an append (or ingest) either commits the whole batch, which then reads
back identical, or raises a RolloutStoreError naming the row and field, and the
store's row count and version are unchanged. Any other exception fails the test.
"""

from __future__ import annotations

import json
import math
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.errors import RolloutStoreError
from rolloutstore.io.ingest import ingest_file

# FUZZ_EXAMPLES=2000 for a deeper run; the default keeps the suite to a few seconds.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FILLED = {"run_id", "prompt_id", "group_id", "sample_index", "num_prompt_tokens",
          "num_completion_tokens", "loss_mask", "num_turns", "num_model_tokens",
          "num_tool_calls", "tools"}  # fmt: skip
# Ids that earlier examples committed: duplicates against the store draw from these.
STORED_IDS: list[str] = []

HOSTILE = st.sampled_from(
    [
        None, True, 1.5, 2.0, -1, 2**31, 2**63, 2**70, -(2**70), math.nan, math.inf, -math.inf,
        0.5, "", "abc", "1", [], [1.5, 2.7], [True], ["a"], [None], {"a": 1}, [[1]], b"x",
    ]
)  # fmt: skip
FIELDS = [
    "rollout_id", "run_id", "prompt_id", "group_id", "sample_index", "policy_version",
    "prompt_ids", "completion_ids", "behavior_logprobs", "temperature", "top_k", "seed",
    "reward", "advantage", "embedding", "created_at", "num_prompt_tokens",
    "num_completion_tokens", "tags", "metadata", "reward_info", "nonexistent_field",
    "loss_mask", "turns", "num_turns", "num_model_tokens", "num_tool_calls", "tools",
]  # fmt: skip
ROLES = ["assistant", "tool", "user", "system"]


@st.composite
def valid_row(draw) -> dict:
    c = draw(st.integers(1, 6))
    return {
        "rollout_id": str(uuid.uuid4()),  # unique; duplicates come from the "dup" mutation
        "policy_version": draw(st.integers(-(2**63), 2**63 - 1)),
        "prompt_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5)),
        "completion_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=c, max_size=c)),
        "behavior_logprobs": draw(st.lists(st.floats(-1e6, 0.0, width=32), min_size=c, max_size=c)),
        "reward": draw(st.none() | st.floats(-1e6, 1e6, width=32)),
        "sample_index": draw(st.integers(0, 2**31 - 1)),
        "tags": draw(st.none() | st.lists(st.text(max_size=4), max_size=3)),
        "metadata": draw(st.none() | st.just('{"k": [1, 2]}')),
    }


@st.composite
def trajectory_row(draw) -> dict:
    """A valid multi-turn row: turns of random roles, mask 1 on some assistant tokens only,
    log-prob 0.0 or None on mask-0 tokens (None is stored as 0.0)."""
    row = draw(valid_row())
    ids, mask, lps, turns = [], [], [], []
    for k in range(draw(st.integers(1, 4))):
        role = "assistant" if k == 0 else draw(st.sampled_from(ROLES))
        n = draw(st.integers(1 if role == "assistant" else 0, 4))
        start = len(ids)
        for _ in range(n):
            ids.append(draw(st.integers(0, 2**31 - 1)))
            m = int(role == "assistant" and (len(ids) == 1 or draw(st.booleans())))
            mask.append(m)
            lps.append(
                draw(st.floats(-1e6, 0.0, width=32)) if m else draw(st.sampled_from([0.0, None]))
            )
        turn = {"role": role, "start": start, "end": len(ids)}
        if role == "tool" and draw(st.booleans()):
            turn["tool_name"] = draw(st.sampled_from(["calculator", "search", ""]))
        turns.append(turn)
    row.update(completion_ids=ids, loss_mask=mask, behavior_logprobs=lps, turns=turns)
    return row


TURN_MUTATIONS = ["mask", "bound", "role", "envlp", "toolname"]


def _mutate_turns(draw, row: dict, kind: str) -> None:
    mask, turns, lps = row.get("loss_mask"), row.get("turns"), row.get("behavior_logprobs")
    if not (isinstance(mask, list) and mask and isinstance(turns, list) and turns):
        return
    if not all(isinstance(t, dict) and isinstance(t.get("end"), int) for t in turns):
        return  # already replaced by a hostile value
    if not all(isinstance(t.get("start"), int) for t in turns):
        return
    if kind == "mask":
        mask[draw(st.integers(0, len(mask) - 1))] = draw(st.sampled_from([0, 1, 2, -1, None]))
    elif kind == "bound" and isinstance(turns[-1], dict):
        t = turns[draw(st.integers(0, len(turns) - 1))]
        t[draw(st.sampled_from(["start", "end"]))] += draw(st.sampled_from([-1, 1, 100]))
    elif kind == "role":
        turns[draw(st.integers(0, len(turns) - 1))]["role"] = draw(
            st.sampled_from(ROLES + ["robot", "", None])
        )
    elif kind == "envlp" and isinstance(lps, list):
        zeros = [i for i, m in enumerate(mask) if m == 0]
        if zeros:
            lps[draw(st.sampled_from(zeros))] = draw(st.sampled_from([-0.5, 0.5, math.nan]))
    elif kind == "toolname":
        turns[draw(st.integers(0, len(turns) - 1))]["tool_name"] = "calculator"


@st.composite
def mutated_row(draw, batch_ids: list[str], hostile: bool) -> dict:
    row = draw(trajectory_row() if draw(st.booleans()) else valid_row())
    for _ in range(draw(st.integers(0, 2)) if hostile else 0):
        kind = draw(
            st.sampled_from(["set", "logprob", "length", "dup", "delete", "negative", "turns"])
        )
        if kind == "turns":
            _mutate_turns(draw, row, draw(st.sampled_from(TURN_MUTATIONS)))
        elif kind == "set":
            row[draw(st.sampled_from(FIELDS))] = draw(HOSTILE)
        elif kind == "logprob":
            bad = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.1, 1e-9, 5.0]))
            lp = row.get("behavior_logprobs")
            if isinstance(lp, list) and lp:
                lp[draw(st.integers(0, len(lp) - 1))] = bad
        elif kind == "length":
            row["behavior_logprobs"] = [-0.1] * draw(st.integers(0, 8))
        elif kind == "dup":
            pool = batch_ids + STORED_IDS[-20:]
            if pool:
                row["rollout_id"] = draw(st.sampled_from(pool))
        elif kind == "delete":
            row.pop(draw(st.sampled_from(sorted(row))), None)
        else:
            ids = row.get("prompt_ids")
            if isinstance(ids, list) and ids:
                ids[0] = -draw(st.integers(1, 2**31))
    if isinstance(row.get("rollout_id"), str):
        batch_ids.append(row["rollout_id"])
    return row


@st.composite
def batches(draw) -> list[dict]:
    ids: list[str] = []
    hostile = draw(st.booleans())  # half the batches are clean: they must commit
    return [draw(mutated_row(ids, hostile)) for _ in range(draw(st.integers(1, 5)))]


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory) -> RolloutStore:
    return RolloutStore.open(tmp_path_factory.mktemp("fuzz") / "store", embedding_dim=4)


def _state(store):
    return store.count(), store.version


def _same(given, stored) -> bool:
    if given is None and stored == 0.0:
        return True  # a null log-prob on an environment token is stored as 0.0
    if isinstance(given, float):
        return (math.isnan(given) and math.isnan(stored)) or np.float32(given) == np.float32(stored)
    if isinstance(given, list):
        return len(given) == len(stored) and all(_same(a, b) for a, b in zip(given, stored))
    if isinstance(given, dict):  # a turn: keys left out are stored null
        return all(_same(given.get(k), v) for k, v in stored.items())
    return given == stored


def _check_derived(r: dict, stored: dict) -> None:
    """The store's multi-turn columns, recomputed here from the row as given."""
    n = len(stored["completion_ids"])
    mask = r.get("loss_mask") or [1] * n
    turns = r.get("turns") or [{"role": "assistant", "start": 0, "end": n}]
    assert stored["loss_mask"] == mask
    assert stored["num_turns"] == len(turns) and stored["num_model_tokens"] == sum(mask)
    assert stored["num_tool_calls"] == sum(t["role"] == "tool" for t in turns)
    names = {t.get("tool_name") for t in turns if t["role"] == "tool"} - {None}
    assert stored["tools"] == sorted(names)


def _check_refusal(exc: RolloutStoreError, store, before, n_rows: int) -> None:
    assert _state(store) == before, "a refused batch changed the store"
    assert getattr(exc, "field", None) is not None, f"no field named: {exc}"
    assert exc.row is not None and 0 <= exc.row < n_rows, f"no row named: {exc}"
    assert f"row {exc.row}" in str(exc) and repr(exc.field) in str(exc)


@SETTINGS
@given(rows=batches(), as_chunks=st.booleans())
def test_append_commits_whole_and_identical_or_refuses_naming_row_and_field(
    fuzz_store, rows, as_chunks
):
    store = fuzz_store
    before = _state(store)
    tag = uuid.uuid4().hex
    for r in rows:
        r["task"] = tag
    data = rows
    if as_chunks and len(rows) > 1:
        data = iter([rows[:1], rows[1:]])  # rows are counted across chunks
    try:
        res = store.append(data)
    except RolloutStoreError as exc:
        _check_refusal(exc, store, before, len(rows))
        event(f"refused: {exc.field}")
        return
    event("committed")
    assert (res.rows, store.count(), res.version) == (
        len(rows),
        before[0] + len(rows),
        before[1] + 1,
    )
    got = store.sql("SELECT * FROM rollouts WHERE task = ? ORDER BY rollout_id", [tag]).to_pylist()
    by_id = {g["rollout_id"]: g for g in got}
    assert len(by_id) == len(rows)
    for r in rows:
        if "rollout_id" not in r or r["rollout_id"] is None:
            continue
        stored = by_id[r["rollout_id"]]
        for k, v in r.items():
            if k == "created_at" or k not in stored or (v is None and k in FILLED):
                continue  # the store fills these (None included) with their defaults
            assert _same(v, stored[k]), (k, v, stored[k])
        _check_derived(r, stored)
        STORED_IDS.append(r["rollout_id"])


# -- ingest: random files and corruptions of good ones -------------------------------------
def _good_rows(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        c = int(rng.integers(1, 6))
        rows.append(
            {
                "policy_version": int(rng.integers(0, 9)),
                "prompt_ids": rng.integers(0, 500, size=int(rng.integers(1, 5))).tolist(),
                "completion_ids": rng.integers(0, 500, size=c).tolist(),
                "behavior_logprobs": (-rng.exponential(1.0, size=c)).tolist(),
                "task": "ingest-fuzz",
            }
        )
    return rows


def _encode(fmt: str, rows: list[dict], tmp) -> bytes:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if fmt == "jsonl":
        return text.encode()
    if fmt == "jsonl.zst":
        return zstandard.ZstdCompressor().compress(text.encode())
    path = tmp / "src.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=8)
    return path.read_bytes()


def _independent_count(fmt: str, data: bytes) -> int | None:
    """Rows a strict reader finds in the file, or None if it is not readable in full."""
    try:
        if fmt == "parquet":
            return pq.read_table(pa.BufferReader(data)).num_rows
        if fmt == "jsonl.zst":
            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        lines = data.decode("utf-8").splitlines()
        return sum(1 for line in lines if line.strip())
    except Exception:
        return None


@settings(
    max_examples=max(1, EXAMPLES * 2 // 5),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fmt=st.sampled_from(["jsonl", "jsonl.zst", "parquet"]),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    corruption=st.sampled_from(["none", "truncate", "flip", "insert", "random"]),
    where=st.floats(0, 1),
    noise=st.binary(min_size=1, max_size=16),
)
# Found by this test: a flipped byte in the footer's column names is invalid UTF-8, which
# pyarrow raised as UnicodeDecodeError (a traceback); now a one-line refusal.
@example(fmt="parquet", n=1, seed=0, corruption="flip", where=0.3125, noise=b"\x00")
def test_ingest_reads_every_file_to_its_end_or_refuses(
    fuzz_store, tmp_path_factory, fmt, n, seed, corruption, where, noise
):
    store = fuzz_store
    tmp = tmp_path_factory.mktemp("f")
    data = _encode(fmt, _good_rows(seed, n), tmp)
    at = int(where * (len(data) - 1))
    if corruption == "truncate":
        data = data[:at]
    elif corruption == "flip":
        data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    elif corruption == "insert":
        data = data[:at] + noise + data[at:]
    elif corruption == "random":
        data = noise * 8
    path = tmp / f"in.{fmt}"
    path.write_bytes(data)
    before = _state(store)
    try:
        res = ingest_file(store, path, progress=False)
    except RolloutStoreError as exc:
        assert _state(store) == before, "a refused file changed the store"
        assert str(path) in str(exc) and "\n" not in str(exc)
        event(f"{fmt} {corruption}: refused")
        return
    event(f"{fmt} {corruption}: committed")
    if corruption == "none":
        assert res.rows == n
    expected = _independent_count(fmt, data)
    assert expected is not None, "accepted a file a strict reader cannot read in full"
    assert res.rows == expected and store.count() == before[0] + res.rows
