"""Where a store's datasets live: their names under the store URI, local folder or object
store, whether a dataset exists, creating a new store's datasets, the manifest versions of
a local dataset, its size, how a full disk shows up in Lance's errors, and retrying a commit
that lost to a concurrent writer."""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Callable
from typing import TypeVar

import lance

from rolloutstore.errors import StoreNotFoundError, WriteConflictError
from rolloutstore.schema import spec as S

T = TypeVar("T")
# Tries of a commit that loses to concurrent writers (compact, migrate, rescore).
COMMIT_ATTEMPTS = 8

ROLLOUTS = "rollouts.lance"
USAGE = "usage.lance"
LINEAGE = "lineage.lance"
REWARDS = "rewards.lance"


def join(root: str, name: str) -> str:
    """``name`` under the store URI ``root``."""
    return root.rstrip("/") + "/" + name


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a local path (or ``file://``), not an object store."""
    return "://" not in uri or uri.startswith("file://")


def exists(uri: str, storage_options: dict | None) -> bool:
    """Whether a Lance dataset exists at ``uri``."""
    if is_local(uri):
        return os.path.isdir(os.path.join(uri.removeprefix("file://"), "_versions"))
    try:
        lance.dataset(uri, storage_options=storage_options)
        return True
    except (ValueError, OSError, FileNotFoundError):
        return False


def create(
    uri: str,
    embedding_dim: int,
    storage_options: dict | None,
    schema_version: int = S.SCHEMA_VERSION,
) -> None:
    """Create the empty rollouts and usage datasets of a new store at ``uri`` (those that
    another process has not created already). ``schema_version``: the current one; an older
    one only to test reading and migrating stores that older releases wrote."""
    if is_local(uri):
        os.makedirs(uri.removeprefix("file://"), exist_ok=True)
    from rolloutstore.store.unique import with_primary_key

    for name, sch in (
        (ROLLOUTS, with_primary_key(S.rollout_schema(embedding_dim, schema_version))),
        (USAGE, S.table_schema("usage")),
    ):
        target = join(uri, name)
        if exists(target, storage_options):
            continue
        try:
            lance.write_dataset(
                sch.empty_table(),
                target,
                schema=sch,
                mode="create",
                storage_options=storage_options,
            )
        except (OSError, ValueError) as exc:
            # Another process created it first: fine, as long as it is there now.
            if not exists(target, storage_options):
                raise StoreNotFoundError(f"could not create {target!r}: {exc}") from exc


def manifest_versions(folder: str) -> dict[int, str]:
    """Version -> manifest file name in a local ``_versions`` folder (either naming scheme:
    V2 names a version ``2**64 - 1 - v``, V1 names it ``v``)."""
    out = {}
    for name in os.listdir(folder):
        stem, dot, ext = name.partition(".")
        if ext != "manifest" or not stem.isdigit():
            continue
        n = int(stem)
        out[(2**64 - 1 - n) if n > 2**63 else n] = name
    return out


def disk_full(exc: OSError) -> bool:
    """Whether ``exc`` says the disk is full."""
    # Lance reports I/O errors from Rust as OSError without errno: match its text too.
    return exc.errno == errno.ENOSPC or "os error 28" in str(exc) or "No space left" in str(exc)


def commit_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is Lance refusing a commit because another writer committed first."""
    from lance.commit import CommitConflictError

    return isinstance(exc, CommitConflictError) or (
        isinstance(exc, OSError) and "commit conflict" in str(exc).lower()
    )


def retry_conflicts(what: str, uri: str, attempt: Callable[[], T]) -> T:
    """``attempt()`` (which reads the datasets afresh each time), run again with a short
    random back-off while its commit loses to a concurrent writer, ``COMMIT_ATTEMPTS`` times
    at most; then WriteConflictError."""
    for tries in range(1, COMMIT_ATTEMPTS + 1):
        try:
            return attempt()
        except OSError as exc:
            if not commit_conflict(exc):
                raise
            if tries == COMMIT_ATTEMPTS:
                raise WriteConflictError(what, uri, COMMIT_ATTEMPTS) from exc
        time.sleep(random.uniform(0, 0.05 * tries))
    raise AssertionError("unreachable")


def bytes_on_disk(uri: str, rollouts: Callable[[], lance.LanceDataset]) -> int | None:
    """Bytes of the rollouts dataset of the store at ``uri`` (``rollouts()`` opens the version
    read, on an object store only); see :meth:`RolloutStore.bytes_on_disk`."""
    if not is_local(uri):
        sizes = [
            f.file_size_bytes for frag in rollouts().get_fragments() for f in frag.metadata.files
        ]
        return None if any(s is None for s in sizes) else int(sum(sizes))
    root = uri.removeprefix("file://")
    total = 0
    for d, _, files in os.walk(os.path.join(root, ROLLOUTS)):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total
