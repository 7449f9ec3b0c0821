"""Query limits for DuckDB connections: a time limit per guarded query (a watchdog thread
calls ``DuckDBPyConnection.interrupt()`` at the deadline), and Ctrl-C interrupting every
guarded query at once while :func:`sigint_interrupts` is active (the CLI)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import weakref
from collections.abc import Iterator

import duckdb

from rolloutstore.errors import QueryError, QueryInterrupted, QueryTimeoutError

_active: weakref.WeakSet = weakref.WeakSet()  # connections running a guarded query
_active_lock = threading.Lock()


@contextlib.contextmanager
def limits(con: duckdb.DuckDBPyConnection, timeout: float | None) -> Iterator[None]:
    """Bound the queries run on ``con`` inside the block to ``timeout`` seconds (None: no bound).

    A watchdog thread calls ``con.interrupt()`` at the deadline, and the interrupted
    query raises :class:`QueryTimeoutError`. While :func:`sigint_interrupts` is active,
    Ctrl-C interrupts the query too, raising ``KeyboardInterrupt``.
    """
    if timeout is not None and not timeout > 0:
        raise QueryError(f"timeout must be > 0 seconds, got {timeout!r}")
    fired = threading.Event()
    timer = None
    if timeout is not None:

        def fire() -> None:
            fired.set()
            con.interrupt()

        timer = threading.Timer(timeout, fire)
        timer.daemon = True
        timer.start()
    with _active_lock:
        _active.add(con)
    try:
        yield
    except duckdb.InterruptException as exc:
        if fired.is_set():
            raise QueryTimeoutError(
                f"the query ran past its time limit of {timeout:g} s and was interrupted; "
                "narrow it (a WHERE, a LIMIT) or raise --timeout / timeout="
            ) from exc
        raise QueryInterrupted("the query was interrupted (Ctrl-C)") from exc
    finally:
        if timer is not None:
            timer.cancel()
        with _active_lock:
            _active.discard(con)


def interrupt_all() -> None:
    """Interrupt every query running under :func:`limits` (the Ctrl-C path)."""
    with _active_lock:
        cons = list(_active)
    for con in cons:
        with contextlib.suppress(Exception):
            con.interrupt()


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """Make Ctrl-C interrupt running DuckDB queries at once (main thread only).

    Python runs its SIGINT handler only between bytecodes, so a query running in
    DuckDB would ignore Ctrl-C until it finished. The C-level handler also writes the
    signal number to a wakeup fd; a watcher thread reads it and interrupts the
    queries, which then return, and ``KeyboardInterrupt`` is raised as usual.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        os.close(r)
        os.close(w)
        yield
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGINT in data or signal.SIGTERM in data:
                interrupt_all()

    t = threading.Thread(target=watch, daemon=True, name="rolloutstore-sigint")
    t.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old)
        os.close(w)  # the watcher reads EOF and ends
        t.join(timeout=5)
        os.close(r)
