"""The store a resumed sync run reads until it has caught up with what the killed run wrote.

A resumed run retakes steps its killed predecessor had taken; those steps drew from the store
as it was then, not as it is now (the killed run may have appended later rounds). The view
below hands the replay loader a read-only snapshot at the version the uninterrupted run read.
"""

from __future__ import annotations

from typing import Any


class ResumeStoreView:
    """The store a sync run's replay loader reads until it has caught up with the store.

    A run killed after appending a round its newest usable checkpoint predates (a
    checkpoint between round boundaries, a fallback past a corrupt checkpoint, or no
    checkpoint yet) left rows in the store that the uninterrupted run had not yet seen
    when it took the steps the resumed run retakes. Up to its next round that run drew
    from the version recorded in the checkpoint (without one: the newest version holding
    none of the run's rows), and after each round from the version that round's last batch
    committed. :attr:`store` is a read-only snapshot at that version while the live store
    holds more, and the live store itself once the run has caught up (or never fell behind).
    """

    def __init__(self, live, run_id: str, state: dict[str, Any] | None):
        self.live, self.run_id = live, run_id
        quoted = run_id.replace("'", "''")
        self._own = f"run_id = '{quoted}'"
        version = state["store_version"] if state is not None else self._before_run()
        self.version = version if version is not None and live.version > version else None
        self.store = live if self.version is None else live.checkout(self.version)

    def _before_run(self) -> int | None:
        """The newest version holding none of this run's rows (None: none anywhere, or the
        versions from before the run's first append were cleaned up)."""
        if not self.live.count(self._own):
            return None
        versions = [v["version"] for v in self.live.versions()]
        lo, hi = 0, len(versions) - 1  # versions[hi] holds rows of the run
        if self.live.checkout(versions[lo]).count(self._own):
            return None
        while hi - lo > 1:  # versions[lo] holds none
            mid = (lo + hi) // 2
            if self.live.checkout(versions[mid]).count(self._own):
                hi = mid
            else:
                lo = mid
        return versions[lo]

    def after_round(self, policy_version: int) -> bool:
        """Move past the round this run generated at ``policy_version`` (all of it now in the
        live store); True when :attr:`store` changed (restart the loader's iterator)."""
        if self.version is None:
            return False
        rows = f"{self._own} AND policy_version = {int(policy_version)}"
        want, latest = self.live.count(rows), self.live.version
        later = [v["version"] for v in self.live.versions() if v["version"] >= self.version]
        v = next(v for v in later if v == latest or self.live.checkout(v).count(rows) == want)
        old, self.version = self.version, (v if v < latest else None)
        self.store = self.live if self.version is None else self.live.checkout(self.version)
        return self.version != old
