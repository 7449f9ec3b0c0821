"""The CPU cores this process may use: the thread counts of the learner, the generators and
vLLM's CPU engine are derived from it (a low layer: config and rollout both need it)."""

from __future__ import annotations

import os


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
