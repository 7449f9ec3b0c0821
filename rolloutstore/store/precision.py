"""Opt-in bounded-error behaviour log-probs (issue [speed] item 4).

Behaviour log-probs are float32 with ~23 bits of noise-like mantissa each, so no lossless
encoding stores them in much under 3.3 bytes/token (docs/benchmarks.md, "Bytes on disk").
A store may instead keep them to a stated absolute error ``bound`` (nats): every value is
rounded to the nearest multiple of ``step = 2**floor(log2(2 * bound))``, so
``|stored - given| <= step / 2 <= bound``. The step is a power of two, so the rounded value
is exact in float32 (its low mantissa bits are zero, which zstd + byte-stream split then
squeeze out) and the column keeps its type: every reader (SQL, take, the loader, export)
is unchanged. Rounding is idempotent: re-storing a stored value changes nothing.

The bound is a property of the store, recorded in its schema metadata
(``rolloutstore.logprob_precision``; absent = 0 = lossless float32, what every store written
before this option has). Every append quantizes at the bound recorded when it starts. The
bound may be raised, never lowered: rows stored under a bound keep that error, so a lower
one recorded later would be false. The learner compares it with what its loss tolerates
(``[loss].logprob_tolerance``, trainer.run.setup).

Effect on importance ratios: every loss here uses pi / mu per token (or GSPO's geometric
mean over a sequence), and an error of at most ``bound`` in log mu moves that ratio by a
factor in ``[exp(-bound), exp(bound)]``: ``|ratio change| <= ratio * (exp(bound) - 1)``,
about 1.2e-3 at bound 1e-3 for a ratio at the clip edge 1.2 (:func:`max_ratio_change`).
"""

from __future__ import annotations

import math

import lance
import numpy as np
import pyarrow as pa

META_PRECISION = b"rolloutstore.logprob_precision"
LOGPROBS = "behavior_logprobs"
# Below this the grid step (and its inverse) would leave float32's normal range.
MIN_BOUND = 2.0**-100


def check_bound(bound: float) -> float:
    """``bound`` as a float, refused unless finite and >= 0 (0 = lossless)."""
    if isinstance(bound, bool) or not isinstance(bound, int | float):
        raise ValueError(f"logprob_precision must be a number of nats >= 0, got {bound!r}")
    if not (math.isfinite(bound) and (bound == 0 or bound >= MIN_BOUND)):
        raise ValueError(
            f"logprob_precision must be finite and 0 (lossless float32) or >= {MIN_BOUND:g} "
            f"nats, got {bound!r}"
        )
    return float(bound)


def grid_step(bound: float) -> float:
    """The power-of-two grid step whose half is the largest one <= ``bound`` (0 for 0)."""
    if bound == 0:
        return 0.0
    return math.ldexp(1.0, math.floor(math.log2(2 * bound)))


def quantize(values: np.ndarray, bound: float) -> np.ndarray:
    """``values`` (float32) rounded to the grid of ``bound``; float32, error <= bound."""
    step = grid_step(bound)
    if step == 0:
        return values
    # Scaling by a power of two is exact in float32, so the rounding is the only error.
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.rint(values * np.float32(1.0 / step))
        out *= np.float32(step)
    beyond = ~np.isfinite(out)  # |x| / step past float32's range: x is on the grid already
    if beyond.any():
        out[beyond] = values[beyond]
    out += np.float32(0.0)  # -0.0 -> 0.0
    return out


def quantize_table(table: pa.Table, bound: float) -> pa.Table:
    """``table`` with its ``behavior_logprobs`` on the grid of ``bound`` (unchanged for 0)."""
    if bound == 0 or LOGPROBS not in table.column_names:
        return table
    col = table.column(LOGPROBS).combine_chunks()
    # The whole child array (a sliced column's offsets need not start at 0: kept as they are).
    values = col.values.to_numpy(zero_copy_only=False)
    new = pa.array(quantize(values, bound), type=pa.float32())
    mask = col.is_null() if col.null_count else None
    arr = pa.ListArray.from_arrays(col.offsets, new, mask=mask)
    arr = arr.cast(col.type)  # the field's encoding metadata
    return table.set_column(table.column_names.index(LOGPROBS), table.field(LOGPROBS), arr)


def recorded(schema: pa.Schema) -> float:
    """The bound a store's schema metadata records (0.0 when absent: lossless)."""
    raw = (schema.metadata or {}).get(META_PRECISION)
    if raw is None:
        return 0.0
    try:
        return check_bound(float(raw.decode()))
    except ValueError as exc:
        raise ValueError(
            f"the store's schema metadata records {META_PRECISION.decode()} = {raw[:40]!r}, "
            "expected a number of nats >= 0: it was damaged or written by another program"
        ) from exc


def record(ds: lance.LanceDataset, bound: float) -> None:
    """Record ``bound`` in the dataset's schema metadata (one commit)."""
    ds.update_schema_metadata({META_PRECISION.decode(): repr(float(bound))})


def max_ratio_change(bound: float, ratio: float = 1.0) -> float:
    """The largest |change| of an importance ratio ``ratio`` when log mu is off by <= bound."""
    return ratio * math.expm1(bound)
