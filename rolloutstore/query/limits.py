"""Query limits for DuckDB connections: a time limit per guarded query (a watchdog thread
calls ``DuckDBPyConnection.interrupt()`` from the deadline on), and Ctrl-C interrupting every
guarded query at once while :func:`sigint_interrupts` is active (the CLI).

A time limit is a finite number of seconds from ``MIN_TIMEOUT`` (1 ms) to ``MAX_TIMEOUT``
(one week); anything else (0, a negative, ``inf``, ``nan``, ``1e300``) is refused before a
query runs. DuckDB forgets an interrupt that arrives while no query is running (a deadline
reached before the query starts, or between two queries of the block), so the watchdog
repeats it every ``REPEAT_S`` until the block ends.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import weakref
from collections.abc import Iterator

import duckdb

from rolloutstore.errors import QueryError, QueryInterrupted, QueryTimeoutError, Terminated

_active: weakref.WeakSet = weakref.WeakSet()  # connections running a guarded query
_active_lock = threading.Lock()

MIN_TIMEOUT = 0.001
MAX_TIMEOUT = 7 * 24 * 3600.0
REPEAT_S = 0.01


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as float seconds (None: no limit), or QueryError naming the range."""
    if timeout is None:
        return None
    ok = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if not (ok and math.isfinite(timeout) and MIN_TIMEOUT <= timeout <= MAX_TIMEOUT):
        raise QueryError(
            f"timeout must be a number of seconds from {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} "
            f"(one week), got {timeout!r}; leave it out for the default"
        )
    return float(timeout)


@contextlib.contextmanager
def limits(con: duckdb.DuckDBPyConnection, timeout: float | None) -> Iterator[None]:
    """Bound the queries run on ``con`` inside the block to ``timeout`` seconds (None: no bound).

    A watchdog thread calls ``con.interrupt()`` at the deadline, and the interrupted
    query raises :class:`QueryTimeoutError`. While :func:`sigint_interrupts` is active,
    Ctrl-C interrupts the query too, raising ``KeyboardInterrupt``.
    """
    timeout = check_timeout(timeout)
    fired, done = threading.Event(), threading.Event()
    watchdog = None
    if timeout is not None:

        def watch() -> None:
            if done.wait(timeout):
                return
            fired.set()
            while True:  # an interrupt landing between queries is forgotten: repeat it
                with contextlib.suppress(Exception):
                    con.interrupt()
                if done.wait(REPEAT_S):
                    return

        watchdog = threading.Thread(target=watch, daemon=True, name="rolloutstore-timeout")
        watchdog.start()
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
        done.set()
        if watchdog is not None:
            watchdog.join()  # no interrupt of this connection after the block
        with _active_lock:
            _active.discard(con)


def interrupt_all() -> None:
    """Interrupt every query running under :func:`limits` (the Ctrl-C path)."""
    with _active_lock:
        cons = list(_active)
    for con in cons:
        with contextlib.suppress(Exception):
            con.interrupt()


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated("terminated (SIGTERM)")


@contextlib.contextmanager
def sigint_interrupts() -> Iterator[None]:
    """Make Ctrl-C (and SIGTERM, raised as :class:`Terminated`) interrupt running DuckDB
    queries at once (main thread only).

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
    # SIGTERM stops the command as Ctrl-C does (Terminated, a KeyboardInterrupt), unless the
    # process already handles it: by default it would die at once, leaving its children
    # (a vLLM engine, actor processes) running and its temporary files behind.
    term = signal.getsignal(signal.SIGTERM)
    if term == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        if term == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(old)
        os.close(w)  # the watcher reads EOF and ends
        t.join(timeout=5)
        os.close(r)
