"""Identifiers: UUIDv7 rollout ids and stable prompt ids."""

from __future__ import annotations

import hashlib
import os
import time
import uuid

import numpy as np
import pyarrow as pa


def uuid7_strings(n: int) -> list[str]:
    """``n`` UUIDv7 strings (RFC 9562): 48-bit ms timestamp, then a 12-bit counter, then random.

    The counter keeps ids from one call in creation order even within one millisecond.
    """
    ms = time.time_ns() // 1_000_000
    rand = os.urandom(8 * n)
    out = []
    for i in range(n):
        seq = i & 0xFFF
        if i and seq == 0:
            ms += 1  # counter wrapped: borrow the next millisecond to stay ordered
        tail = int.from_bytes(rand[8 * i : 8 * i + 8], "big") & ((1 << 62) - 1)
        value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | seq << 64 | 0b10 << 62 | tail
        out.append(str(uuid.UUID(int=value)))
    return out


def prompt_ids_hash(prompt_ids: pa.Array) -> list[str]:
    """Stable 16-hex-digit BLAKE2b digest of each row's int32 prompt token ids."""
    arr = prompt_ids.cast(pa.list_(pa.int32()))
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype("<i4", copy=False)
    buf = values.tobytes()
    out = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        out.append(hashlib.blake2b(buf[4 * start : 4 * end], digest_size=8).hexdigest())
    return out


def prompt_id_of(token_ids) -> str:
    """The prompt id of one prompt's token ids (same as the store computes)."""
    arr = np.asarray(token_ids, dtype="<i4")
    return hashlib.blake2b(arr.tobytes(), digest_size=8).hexdigest()


def deterministic_uuid7(key: str, ms: int) -> str:
    """A UUIDv7-shaped id that is a pure function of ``key`` (and ``ms``, its time field).

    Reproducible runs give rollouts the same ids when they regenerate them after a
    resume; ``ms`` is the run's start time, so ids still sort by run.
    """
    rand = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=10).digest(), "big")
    rand_a, rand_b = rand >> 62 & 0xFFF, rand & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return str(uuid.UUID(int=value))
