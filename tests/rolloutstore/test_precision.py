"""Bytes on disk (issue [speed] items 3, 4): the default store reads back every column bit for
bit on both peer workloads; the opt-in log-prob bound holds, is recorded, only rises, and
the learner refuses a store coarser than its loss tolerates."""

from __future__ import annotations

import math

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.store import precision
from tools.bench_bytes import same_bits
from tools.peer_workloads import workload_table


def _flat(table: pa.Table, column: str = "behavior_logprobs") -> np.ndarray:
    return pc.list_flatten(table[column]).to_numpy()


# -- item 3: lossless by default ----------------------------------------------------------------
@pytest.mark.parametrize("workload", ["table", "long"])
def test_default_store_reads_back_every_column_bit_exact(tmp_path, workload):
    table = workload_table(workload, 48, seed=3)
    store = RolloutStore.open(tmp_path / "s")
    store.append(table)
    back = store.dataset().to_table()
    assert store.logprob_precision == 0.0
    assert same_bits(back, table.cast(back.select(table.column_names).schema))


def test_same_bits_sees_a_one_ulp_change():
    """The comparison the lossless test relies on is bit-level, not approximate."""
    table = workload_table("table", 16, seed=0)
    values = _flat(table).copy()
    values[5] = np.nextafter(values[5], np.float32(-1))
    col = table["behavior_logprobs"].combine_chunks()
    changed = table.set_column(
        table.column_names.index("behavior_logprobs"),
        "behavior_logprobs",
        pa.ListArray.from_arrays(col.offsets, pa.array(values)),
    )
    assert not same_bits(changed, table)


def test_a_store_written_before_the_option_opens_lossless_and_takes_a_bound(tmp_path):
    """A store from before logprob_precision (no metadata key) reads as lossless, keeps its
    rows bit for bit when a bound is set later, and quantizes only what comes after."""
    old = workload_table("table", 32, seed=1)
    new = workload_table("table", 32, seed=2)
    store = RolloutStore.open(tmp_path / "s")
    store.append(old)
    schema = lance.dataset(str(tmp_path / "s" / "rollouts.lance")).schema
    assert precision.META_PRECISION not in (schema.metadata or {})
    reopened = RolloutStore.open(tmp_path / "s", create=False)
    assert reopened.logprob_precision == 0.0
    reopened.set_logprob_precision(1e-3)
    reopened.append(new)
    back = reopened.dataset().to_table(columns=["behavior_logprobs"])
    n = len(_flat(old))
    assert np.array_equal(_flat(back)[:n].view(np.uint32), _flat(old).view(np.uint32))
    err = np.abs(_flat(back)[n:] - _flat(new))
    assert err.max() <= 1e-3 and err.max() > 0


# -- item 4: bounded error ----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.floats(
            max_value=0.0, width=32, allow_nan=False, allow_infinity=False
        ),  # any finite float32 <= 0
        min_size=1,
        max_size=64,
    ),
    bound=st.floats(min_value=1e-7, max_value=10.0),
)
def test_quantize_error_is_within_the_bound_and_idempotent(values, bound):
    x = np.asarray(values, dtype=np.float32)
    q = precision.quantize(x, bound)
    assert q.dtype == np.float32
    assert np.all(np.abs(q.astype(np.float64) - x.astype(np.float64)) <= bound)
    assert np.all(q <= 0) and not np.any(np.signbit(q) & (q == 0))  # <= 0, never -0.0
    assert np.array_equal(precision.quantize(q, bound), q)


def test_store_round_trip_error_within_bound_and_recorded(tmp_path):
    table = workload_table("long", 16, seed=4)
    store = RolloutStore.open(tmp_path / "s")
    assert store.set_logprob_precision(1e-3) == 1e-3
    store.append(table)
    reopened = RolloutStore.open(tmp_path / "s", create=False)
    assert reopened.logprob_precision == 1e-3
    back = reopened.dataset().to_table()
    err = np.abs(_flat(back).astype(np.float64) - _flat(table))
    assert err.max() <= 1e-3
    # Only the log-probs are rounded: token ids and everything else are as given.
    rest = [c for c in table.column_names if c != "behavior_logprobs"]
    assert same_bits(back.select(rest), table.select(rest).cast(back.select(rest).schema))
    reopened.compact()
    assert RolloutStore.open(tmp_path / "s", create=False).logprob_precision == 1e-3


def test_the_bound_rises_but_never_falls(tmp_path):
    store = RolloutStore.open(tmp_path / "s")
    store.set_logprob_precision(1e-3)
    with pytest.raises(ValueError, match="cannot be lowered"):
        store.set_logprob_precision(0.0)
    store.set_logprob_precision(1e-2)
    assert store.logprob_precision == 1e-2
    with pytest.raises(ValueError, match="0 \\(lossless"):
        store.set_logprob_precision(-1.0)
    with pytest.raises(ValueError, match="finite"):
        store.set_logprob_precision(math.inf)


def test_ratio_change_bound_is_what_the_docs_state():
    assert precision.max_ratio_change(1e-3) == pytest.approx(1.0005e-3, rel=1e-3)
    assert precision.max_ratio_change(1e-3, ratio=1.2) == pytest.approx(1.2006e-3, rel=1e-3)
    assert precision.grid_step(1e-3) == 2.0**-9


def test_a_v1_store_keeps_its_bound_through_migrate(tmp_path):
    """Migration rewrites the schema metadata; the recorded bound must survive it (else the
    learner would take rounded log-probs for exact ones)."""
    from rolloutstore.store import layout
    from rolloutstore.store import migrate as M

    layout.create(str(tmp_path / "v1"), 64, None, schema_version=1)
    store = RolloutStore.open(tmp_path / "v1")
    store.set_logprob_precision(1e-2)
    store.append([{"prompt_ids": [1], "completion_ids": [2, 3], "behavior_logprobs": [-0.123, -1.0],
                   "policy_version": 0}])  # fmt: skip
    assert M.migrate(store).to_version == 2
    migrated = RolloutStore.open(tmp_path / "v1", create=False)
    assert migrated.schema_version == 2 and migrated.logprob_precision == 1e-2
    got = _flat(migrated.dataset().to_table(columns=["behavior_logprobs"]))
    assert np.all(np.abs(got - np.array([-0.123, -1.0])) <= 1e-2)
