"""Store upkeep that rewrites no row: compaction of the rollouts and usage datasets (run again,
bounded, when it loses a commit race to concurrent appenders), and
recovery from a torn newest manifest (open the newest readable version read-only, then
move the unreadable manifests aside on :meth:`RolloutStore.repair`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lance

from rolloutstore.errors import CorruptStoreError, DiskFullError
from rolloutstore.store.layout import (
    ROLLOUTS,
    USAGE,
    disk_full,
    join,
    manifest_versions,
    retry_conflicts,
)

OpenDataset = Callable[..., lance.LanceDataset]  # (name, version=None) -> dataset


def compact(uri: str, open_ds: OpenDataset, cleanup_older_than: timedelta | None) -> dict[str, Any]:
    """Compact the rollouts and usage datasets of the store at ``uri``; see
    :meth:`RolloutStore.compact`."""
    out = {}
    for name in (ROLLOUTS, USAGE):

        def attempt(name: str = name):  # a fresh read of the dataset each time
            return open_ds(name).optimize.compact_files()

        try:  # appenders commit meanwhile; a compaction that loses to one runs again
            metrics = retry_conflicts(f"compaction of {name}", uri, attempt)
        except OSError as exc:
            if disk_full(exc):
                raise DiskFullError(f"compaction of {name}", uri) from exc
            raise
        out[name.split(".")[0]] = {
            "fragments_removed": metrics.fragments_removed,
            "fragments_added": metrics.fragments_added,
        }
        if cleanup_older_than is not None:
            stats = open_ds(name).cleanup_old_versions(older_than=cleanup_older_than)
            out[name.split(".")[0]]["bytes_removed"] = stats.bytes_removed
    return out


def open_newest_readable(
    uri: str, open_ds: OpenDataset, exc: Exception
) -> tuple[lance.LanceDataset, int, int]:
    """The newest version of rollouts cannot be opened (a torn manifest, ``exc``): open the
    newest one that can, with one warning naming both. Returns (dataset, its version, the
    unreadable newest version); raises CorruptStoreError when no version opens."""
    folder = os.path.join(uri.removeprefix("file://"), ROLLOUTS, "_versions")
    versions = sorted(manifest_versions(folder), reverse=True)
    for v in versions[1:]:
        try:
            ds = open_ds(ROLLOUTS, v)
        except (OSError, ValueError, RuntimeError):
            continue
        bad = versions[0]
        warnings.warn(
            f"store {uri!r}: version {bad} of {ROLLOUTS} is unreadable "
            f"({str(exc).splitlines()[0]}); opened version {v} read-only instead. Writes "
            "are refused until it is repaired (RolloutStore.repair(), after checking "
            "the disk)",
            RuntimeWarning,
            stacklevel=4,  # the caller of RolloutStore.open
        )
        return ds, v, bad
    raise CorruptStoreError(
        f"no readable version of {join(uri, ROLLOUTS)!r}: expected a manifest Lance "
        f"can open, found {len(versions)} that fail ({str(exc).splitlines()[0]}); restore "
        "the store from a copy"
    ) from exc


def move_torn_aside(uri: str, good: int) -> None:
    """Move the manifests of rollouts newer than ``good`` into ``rollouts.lance/_torn/``."""
    folder = os.path.join(uri.removeprefix("file://"), ROLLOUTS)
    aside = os.path.join(folder, "_torn")
    os.makedirs(aside, exist_ok=True)
    for v, name in manifest_versions(os.path.join(folder, "_versions")).items():
        if v > good:
            os.replace(os.path.join(folder, "_versions", name), os.path.join(aside, name))
    hint = os.path.join(folder, "_versions", "latest_version_hint.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(hint)
