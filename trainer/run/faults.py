"""Fault injection for the crash-safety tests: a process SIGKILLs itself at a named point.

``ROLLOUTSTORE_FAULT=step:7`` kills the learner after step 7 (``generate:R:B`` after batch B
of round R is appended); ``ROLLOUTSTORE_ACTOR_FAULT=K:R`` kills actor K in round R.
Unset (always, outside tests), these are no-ops.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "ROLLOUTSTORE_FAULT"
ACTOR_FAULT_ENV = "ROLLOUTSTORE_ACTOR_FAULT"  # "K:R": actor K SIGKILLs itself in round R


def crash_at(where: str) -> None:
    """SIGKILL this process when ROLLOUTSTORE_FAULT names ``where`` (crash-safety tests).

    Under torchrun, ROLLOUTSTORE_FAULT_RANK=R limits the fault to rank R.
    """

    if os.environ.get(FAULT_ENV) != where:
        return
    only = os.environ.get("ROLLOUTSTORE_FAULT_RANK")
    if only is None or only == os.environ.get("RANK", "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def actor_crash(actor_id: int, rnd: int, batch: int) -> None:
    """SIGKILL this actor after round R's first batch when ROLLOUTSTORE_ACTOR_FAULT="K:R"."""
    spec = os.environ.get(ACTOR_FAULT_ENV)
    if spec and batch == 0 and spec == f"{actor_id}:{rnd}":
        os.kill(os.getpid(), signal.SIGKILL)
