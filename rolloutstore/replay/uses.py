"""Use counts for ``ReplayConfig.max_uses``: per rollout, this run's draws at earlier steps
(counted in memory, seeded from the usage log at the step a selector starts or resumes
from) plus other runs' distinct (run, step) uses, read from the usage log incrementally."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa

Sql = Callable[..., pa.Table]  # (tables, query, params) -> result, on the selector's connection


class UseCounts:
    """The use counts a selector keeps for its run; see the module docstring."""

    def __init__(self) -> None:
        self.own: dict[str, int] | None = None  # None: re-read from the usage log
        self._usage_seen: set[int] = set()
        self._others: dict[str, set] = {}

    def forget_own(self) -> None:
        """Re-read this run's uses from the usage log (up to the step) on the next count."""
        self.own = None

    def add_own(self, rollout_ids: Iterable[str]) -> None:
        """Count one use of each of ``rollout_ids`` (a draw of this run), once per rollout."""
        if self.own is not None:
            for rid in set(rollout_ids):
                self.own[rid] = self.own.get(rid, 0) + 1

    def table(self, sql: Sql, usage: Any, buf: pa.Table, run_id: str, step: int) -> pa.Table:
        """Use counts of the buffer's rollouts: run ``run_id``'s before ``step`` (in memory)
        plus other runs'."""
        if self.own is None:
            own = sql(
                {"usage": usage},
                "SELECT rollout_id, count(DISTINCT learner_step) AS n FROM usage "
                "WHERE run_id = ? AND learner_step < ? GROUP BY 1",
                [run_id, step],
            )
            self.own = dict(zip(own["rollout_id"].to_pylist(), own["n"].to_pylist()))
        others = self._other_uses(usage, run_id)
        ids = buf["rollout_id"].to_pylist()
        counts = [self.own.get(r, 0) + len(others.get(r, ())) for r in ids]
        return pa.table(
            {"rollout_id": pa.array(ids, pa.string()), "n": pa.array(counts, pa.int64())}
        )

    def _other_uses(self, usage, run_id: str) -> dict[str, set]:
        """Other runs' distinct (run, step) uses per rollout, read incrementally.

        The usage log only grows by new fragments, so each is read once; if a
        compaction replaced fragments, the counts are rebuilt from scratch.
        """
        frags = usage.get_fragments()
        ids = {f.fragment_id for f in frags}
        if not self._usage_seen <= ids:
            self._usage_seen, self._others = set(), {}
        new = [f for f in frags if f.fragment_id not in self._usage_seen]
        if new:
            own = run_id.replace("'", "''")
            t = usage.scanner(
                columns=["rollout_id", "run_id", "learner_step"],
                fragments=new,
                filter=f"run_id <> '{own}'",
            ).to_table()
            for rid, other, step in zip(
                t["rollout_id"].to_pylist(), t["run_id"].to_pylist(), t["learner_step"].to_pylist()
            ):
                self._others.setdefault(rid, set()).add((other, step))
            self._usage_seen |= {f.fragment_id for f in new}
        return self._others
