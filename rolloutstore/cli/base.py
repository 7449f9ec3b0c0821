"""What both command lines share (``rolloutstore`` and ``rolloutstore-train``): the parser
that turns usage mistakes into one-line errors, the error policy, and opening a store argument.

Error policy: a user error (any RolloutStoreError, a bad argument, a path that does not exist,
an exception class with ``user_facing = True``, or what the calling CLI adds) prints one line
``error: ...`` to stderr and exits 2; ``--debug`` (or ``ROLLOUTSTORE_DEBUG=1``) shows the
traceback instead; anything else is a bug and keeps its traceback. Ctrl-C exits 130;
SIGTERM stops the command the same way (its cleanup runs) and exits 143.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Callable

from rolloutstore.errors import QueryInterrupted, RolloutStoreError, Terminated, UsageError
from rolloutstore.query.limits import sigint_interrupts

# Commands that need a model, now in `rolloutstore-train` (same arguments).
MOVED = {"generate": "rolloutstore-train generate", "rescore": "rolloutstore-train rescore"}


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (printed as one line) rather than a bug."""
    if isinstance(exc, RolloutStoreError | tomllib.TOMLDecodeError):
        return True
    if getattr(type(exc), "user_facing", False) is True:
        return True
    # a path the user gave does not exist / is a folder / is not readable
    return isinstance(exc, OSError) and getattr(exc, "filename", None) is not None


def run_main(
    build_parser: Callable[[], argparse.ArgumentParser],
    argv: list[str] | None,
    *,
    user_error: Callable[[BaseException], bool] = is_user_error,
    interrupted: str = "interrupted",
) -> int:
    """Parse ``argv``, run ``args.func(args)``; apply the error policy (module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("ROLLOUTSTORE_DEBUG") == "1"
    try:
        args = build_parser().parse_args(argv)
        with sigint_interrupts():
            args.func(args)
    except Terminated:
        if debug:
            raise
        print("error: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except (KeyboardInterrupt, QueryInterrupted):
        if debug:
            raise
        print(f"error: {interrupted}", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not user_error(exc):
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[6:].lstrip() if text.startswith("error:") else text


def add_debug_flag(parser: argparse.ArgumentParser, commands) -> None:
    """``--debug`` before the command and after it (``commands``: the add_subparsers object)."""
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    for sub in commands.choices.values():
        if sub.prefix_chars != "-":  # a placeholder that takes no options
            continue
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks of errors")  # fmt: skip


def store_path(path: str) -> str:
    """``path``, or the store inside it when it is a training run's folder (``RUN/store``)
    and no store itself: said in one line on stderr."""
    from rolloutstore.store.layout import ROLLOUTS, exists, is_local

    if not is_local(path) or not os.path.isdir(path) or exists(os.path.join(path, ROLLOUTS), None):
        return path
    inner = os.path.join(path, "store")
    if not exists(os.path.join(inner, ROLLOUTS), None):
        return path
    print(f"{path} is a run folder: using its store {inner}", file=sys.stderr)
    return inner


def open_store(path: str, *, create: bool = False):
    """The store a command names (``RolloutStore.open``); a run folder names its store."""
    from rolloutstore.facade import RolloutStore

    return RolloutStore.open(store_path(path), create=create)
