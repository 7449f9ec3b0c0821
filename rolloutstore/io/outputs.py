"""Where ``export`` and ``sql --out`` write: the output path checked, resolved and opened.

    target = output_target("out/rollouts.parquet", what="export output")
    with open_output(target) as f:      # a binary file object
        f.write(...)

An output path is resolved (symlinks followed) and written according to what it names:

- nothing yet, or a regular file: written to a hidden temp file beside the real file
  (``.NAME.tmp-PID``, NAME cut so that the temp name fits the filesystem's name limit) and
  renamed over it when complete; a failure (a full disk, Ctrl-C) removes the temp file and
  leaves the old file as it was. A symlink to a file is followed, so the file it points to is
  replaced and the symlink stays.
- an existing character device or FIFO (``/dev/null``, a terminal, a named pipe, or a
  symlink to one), or an open file descriptor whatever it is (``/dev/stdout``,
  ``/dev/fd/N``, ``/proc/self/fd/N``: a shell redirection may point it at a regular file that
  the shell keeps open): written in place (appended to), streamed, never renamed over.
  Renaming a regular file over ``/dev/null`` as root would replace the machine's
  ``/dev/null``.
- anything else that exists (a block device, a socket, a folder where a file is expected):
  refused.
- inside a store or Lance dataset folder: refused (:func:`check_output_path`).

A full disk or device is one :class:`OutputDiskFullError` (``error: ...`` on the CLI).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rolloutstore.errors import OutputDiskFullError, OutputPathError
from rolloutstore.store.layout import disk_full

PID_DIGITS = 10  # room kept for the PID in a temp name (Linux pid_max is at most 2**22)


def check_output_path(path: str | os.PathLike, *, what: str = "output") -> str:
    """Refuse an output path inside a store or Lance dataset folder (symlinks resolved).

    Writing there (a manifest, a data file, the store folder itself) would corrupt
    the store, so ``export`` and ``sql --out`` refuse it with OutputPathError.
    """
    raw = os.fspath(path)
    if "://" in raw:
        return raw
    real = Path(os.path.realpath(raw))
    for folder in (real, *real.parents):
        if folder.name.endswith(".lance") or (folder / "rollouts.lance").is_dir():
            kind = "Lance dataset" if folder.name.endswith(".lance") else "store"
            raise OutputPathError(
                f"refusing to write the {what} {raw!r}: it lies inside the {kind} folder "
                f"{str(folder)!r} (resolved: {str(real)!r}) and would corrupt it; "
                "write it outside every store folder"
            )
    return raw


@dataclass(frozen=True)
class OutputTarget:
    """A checked output: ``given`` (as the user wrote it), ``path`` (symlinks resolved: what is
    written), ``in_place`` (an existing device or FIFO, written directly) and ``what``."""

    given: str
    path: str
    in_place: bool
    what: str


def output_target(out: str | os.PathLike, *, what: str, folder: bool = False) -> OutputTarget:
    """``out`` checked and resolved (module docstring); ``folder``: the output is a folder
    (``export --format hf``), which may not be a device or FIFO."""
    given = check_output_path(out, what=what)
    path = os.path.realpath(given)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return OutputTarget(given, path, False, what)
    if not folder and _names_open_fd(given):
        return OutputTarget(given, given, True, what)
    if stat.S_ISREG(mode) and not folder:
        return OutputTarget(given, path, False, what)
    if stat.S_ISDIR(mode) and folder:
        return OutputTarget(given, path, False, what)
    if (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)) and not folder:
        return OutputTarget(given, path, True, what)
    found = _kind(mode)
    expected = "a new folder" if folder else "a file, a character device or a FIFO"
    raise OutputPathError(
        f"refusing to write the {what} {given!r}: expected {expected}, found {found} "
        f"({path!r}); choose another path"
    )


_FD_FOLDER = re.compile(r"/proc/[^/]+(/task/[^/]+)?/fd")


def _names_open_fd(path: str) -> bool:
    """Whether ``path``, followed link by link, passes through a process's ``fd`` folder."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on nested symlinks
        if _FD_FOLDER.fullmatch(os.path.realpath(os.path.dirname(p))):
            return True
        try:
            link = os.readlink(p)
        except OSError:
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), link))
    return False


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
    ):  # fmt: skip
        if test(mode):
            return name
    return "something that is not a file"


def temp_path(path: str) -> str:
    """The hidden temp name beside ``path`` for this process: ``.NAME.tmp-PID``, NAME cut
    (in bytes) so the name fits the folder's name limit for any PID."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f"{_temp_prefix(parent, name)}{os.getpid()}")


def _temp_prefix(parent: str, name: str) -> str:
    try:
        name_max = os.pathconf(parent or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = name_max - len(".") - len(".tmp-") - PID_DIGITS
    raw = os.fsencode(name)
    if len(raw) > room:
        name = os.fsdecode(raw[:room])  # a cut multi-byte character stays as its bytes
    return f".{name}.tmp-"


def remove_stale_temps(path: str) -> None:
    """Remove the temp outputs beside ``path`` whose process is gone (e.g. killed)."""
    parent, name = os.path.split(path)
    prefix = _temp_prefix(parent, name)
    try:
        entries = os.listdir(parent or ".")
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(prefix) or not entry[len(prefix) :].isdigit():
            continue
        try:
            os.kill(int(entry[len(prefix) :]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except OSError:
            continue
        remove_temp(os.path.join(parent, entry))


def remove_temp(tmp: str) -> None:
    """Remove a temp output (a file or a folder) if it exists."""
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(tmp)


@contextlib.contextmanager
def open_output(target: OutputTarget) -> Iterator[BinaryIO]:
    """A binary file to write ``target`` through: the device or FIFO itself when
    ``in_place``, else a temp file renamed over ``target.path`` when the block ends
    without error (removed on any error). A full disk raises OutputDiskFullError."""
    if target.in_place:
        # Appended to: an open descriptor (`>> log`) keeps what was written before.
        with _disk_full_as_error(target), open(target.path, "ab") as f:
            yield f
        return
    tmp = temp_path(target.path)
    try:
        with _disk_full_as_error(target):
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, target.path)
    finally:  # also on KeyboardInterrupt / SystemExit: no partial or hidden temp output
        remove_temp(tmp)


@contextlib.contextmanager
def output_folder(target: OutputTarget) -> Iterator[str]:
    """A temp folder path to write ``target`` (a folder) into, renamed over the (empty or
    missing) ``target.path`` when the block ends without error, removed on any error."""
    tmp = temp_path(target.path)
    try:
        with _disk_full_as_error(target):
            yield tmp
            if os.path.isdir(target.path):
                os.rmdir(target.path)  # empty (the caller checked)
            os.replace(tmp, target.path)
    finally:
        remove_temp(tmp)


@contextlib.contextmanager
def _disk_full_as_error(target: OutputTarget) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if disk_full(exc):
            raise OutputDiskFullError(target.what, target.given, target.in_place) from exc
        raise
