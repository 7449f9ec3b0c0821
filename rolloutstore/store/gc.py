"""Garbage collection: files a killed process left behind that no version references.

A Lance append writes its data files first and commits a manifest last, so an
appender killed in between leaves data files under ``*.lance/data/`` that no
manifest names (invisible to readers, but they take disk, and ``compact`` never
sees them). A killed export leaves a hidden ``.OUT.tmp-PID`` next to its output.
:func:`collect` removes a data file only when no *retained* version of its dataset
references it and it is older than ``min_age`` -- an append still in flight has
written its files but not yet committed them, and the age keeps them safe.
Readers only ever open retained versions, so they never lose a file they need.
Local stores only (on an object store, use a bucket lifecycle rule on ``data/``).

    rolloutstore gc STORE [--min-age-hours 1] [--exports DIR ...] [--dry-run]
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import lance

from rolloutstore.errors import CorruptStoreError
from rolloutstore.store.layout import LINEAGE, REWARDS, ROLLOUTS, USAGE, exists, is_local, join

DEFAULT_MIN_AGE = timedelta(hours=1)
EXPORT_TMP = re.compile(r"^\..+\.tmp-(\d+)$")


@dataclass(frozen=True)
class GcResult:
    removed: list[str] = field(default_factory=list)  # paths removed (or that would be)
    bytes_removed: int = 0
    kept_young: int = 0  # unreferenced, but younger than min_age: maybe an append in flight
    versions_checked: int = 0


def referenced_files(ds: lance.LanceDataset) -> tuple[set[str], int]:
    """Data file names (relative to ``data/``) referenced by any retained version."""
    names: set[str] = set()
    try:
        versions = [v["version"] for v in ds.versions()]
        for v in versions:
            for frag in ds.checkout_version(v).get_fragments():
                names.update(f.path for f in frag.metadata.files)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CorruptStoreError(
            f"gc needs every retained version of {ds.uri!r} to be readable, found one that is "
            f"not ({str(exc).splitlines()[0]}); nothing was removed; repair the store first"
        ) from exc
    return names, len(versions)


def collect_dataset(
    ds: lance.LanceDataset, *, min_age: timedelta = DEFAULT_MIN_AGE, dry_run: bool = False
) -> GcResult:
    """Remove the unreferenced data files of one local dataset older than ``min_age``."""
    root = ds.uri.removeprefix("file://")
    data = os.path.join(root, "data")
    if not os.path.isdir(data):
        return GcResult()
    # List the folder before reading the versions: a file committed in between is then
    # referenced by a version we read, or too young to be touched.
    listed = sorted(os.listdir(data))
    keep, n_versions = referenced_files(ds)
    cutoff = time.time() - min_age.total_seconds()
    removed, nbytes, young = [], 0, 0
    for name in listed:
        if name in keep:
            continue
        path = os.path.join(data, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_mtime > cutoff:
            young += 1
            continue
        if not dry_run:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue
        removed.append(path)
        nbytes += st.st_size
    return GcResult(removed, nbytes, young, n_versions)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_export_temps(
    folders: Iterable[str | os.PathLike],
    *,
    min_age: timedelta = DEFAULT_MIN_AGE,
    dry_run: bool = False,
) -> GcResult:
    """Remove ``.NAME.tmp-PID`` files/folders of killed exports (PID gone, older than
    ``min_age``) in ``folders``."""
    import shutil

    cutoff = time.time() - min_age.total_seconds()
    removed, nbytes, young = [], 0, 0
    for folder in folders:
        for entry in os.scandir(os.fspath(folder)):
            m = EXPORT_TMP.match(entry.name)
            if not m:
                continue
            st = entry.stat(follow_symlinks=False)
            if st.st_mtime > cutoff or _alive(int(m.group(1))):
                young += 1
                continue
            size = st.st_size
            if entry.is_dir(follow_symlinks=False):
                size = sum(
                    os.path.getsize(os.path.join(d, f))
                    for d, _, fs in os.walk(entry.path)
                    for f in fs
                )
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
            elif not dry_run:
                os.remove(entry.path)
            removed.append(entry.path)
            nbytes += size
    return GcResult(removed, nbytes, young, 0)


def merge(results: Iterable[GcResult]) -> GcResult:
    out = GcResult()
    for r in results:
        out = GcResult(
            out.removed + r.removed,
            out.bytes_removed + r.bytes_removed,
            out.kept_young + r.kept_young,
            out.versions_checked + r.versions_checked,
        )
    return out


def collect_store(
    uri: str,
    storage_options: dict | None,
    *,
    min_age: timedelta = DEFAULT_MIN_AGE,
    exports: Sequence[str | os.PathLike] = (),
    dry_run: bool = False,
) -> GcResult:
    """Collect every dataset of the store at ``uri`` and the export temps in ``exports``;
    see :meth:`RolloutStore.gc`."""
    if not is_local(uri):
        raise ValueError(
            f"gc works on local stores; {uri!r} is an object store: expire "
            "unreferenced data/ files with a bucket lifecycle rule instead"
        )
    results = [
        collect_dataset(
            lance.dataset(join(uri, name), storage_options=storage_options),
            min_age=min_age,
            dry_run=dry_run,
        )
        for name in (ROLLOUTS, USAGE, REWARDS, LINEAGE)
        if exists(join(uri, name), storage_options)
    ]
    results.append(collect_export_temps(exports, min_age=min_age, dry_run=dry_run))
    return merge(results)


def references_any(uri: str, storage_options: dict | None, fragments: list) -> bool:
    """Whether the latest rollouts version of the store at ``uri`` references a file of
    ``fragments`` (True when it cannot tell: keep the files then)."""
    ours = {f.path for frag in fragments for f in frag.files}
    try:
        latest = lance.dataset(join(uri, ROLLOUTS), storage_options=storage_options)
        return any(f.path in ours for fr in latest.get_fragments() for f in fr.metadata.files)
    except (OSError, ValueError, RuntimeError):
        return True  # cannot tell: keep the files (gc collects them if unreferenced)


def discard_fragments(uri: str, fragments: list, dataset: str = ROLLOUTS) -> None:
    """Remove the data files of uncommitted ``fragments`` of ``dataset`` (rollouts by
    default) now (local stores)."""
    if not is_local(uri):
        return
    data = os.path.join(uri.removeprefix("file://"), dataset, "data")
    for frag in fragments:
        for f in frag.files:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(data, f.path))
