"""rolloutstore: a disk-backed rollout store for LLM RL with experience replay.

from rolloutstore import RolloutStore
store = RolloutStore.open("runs/demo/store")
"""

from __future__ import annotations

from .errors import (
    IngestError,
    QueryError,
    ReadOnlyError,
    RolloutStoreError,
    SchemaError,
    SchemaVersionError,
    StoreNotFoundError,
    ValidationError,
)
from .store import AppendResult, EvictResult, RolloutStore

__version__ = "0.1.0"

__all__ = [
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
