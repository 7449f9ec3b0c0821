"""Replay: the buffer as a view of the store, selection in DuckDB, a streaming torch loader.

``ReplayDataset`` is imported lazily so that importing rolloutstore never imports torch.
"""

from __future__ import annotations

from rolloutstore.replay.config import ReplayConfig
from rolloutstore.replay.selector import EmptyBufferError, Selection, Selector

__all__ = ["EmptyBufferError", "ReplayConfig", "ReplayDataset", "Selection", "Selector"]


def __getattr__(name: str):
    if name == "ReplayDataset":
        from rolloutstore.replay.loader import ReplayDataset

        return ReplayDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
