"""rolloutstore: a disk-backed rollout store for LLM RL with experience replay.

from rolloutstore import RolloutStore
store = RolloutStore.open("runs/demo/store")
"""

from __future__ import annotations

from rolloutstore.errors import (
    IngestError,
    QueryError,
    ReadOnlyError,
    RolloutStoreError,
    SchemaError,
    SchemaVersionError,
    StoreNotFoundError,
    ValidationError,
)
from rolloutstore.facade import EvictResult, RolloutStore
from rolloutstore.replay import EmptyBufferError, ReplayConfig, Selection, Selector
from rolloutstore.store.log import AppendResult

__version__ = "0.1.0"

__all__ = [
    "EmptyBufferError",
    "ReplayConfig",
    "ReplayDataset",
    "Selection",
    "Selector",
    "IngestError",
    "AppendResult",
    "EvictResult",
    "QueryError",
    "ReadOnlyError",
    "RolloutStore",
    "RolloutStoreError",
    "SchemaError",
    "SchemaVersionError",
    "StoreNotFoundError",
    "ValidationError",
]


def __getattr__(name: str):
    # The torch loader is imported on first use only.
    if name == "ReplayDataset":
        from rolloutstore.replay.loader import ReplayDataset

        return ReplayDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
