"""``RolloutStore``: the store a user opens. The append-only log (:mod:`rolloutstore.store`)
with SQL over it, plus the operations built on top of it: statistics, retention (evict),
re-scoring and export. Each method is a typed front for one module below.

    from rolloutstore import RolloutStore
    store = RolloutStore.open("runs/demo/store")
    store.append([{"prompt_ids": [1, 2], "completion_ids": [3], "behavior_logprobs": [-0.1],
                   "policy_version": 0}])
    store.sql("SELECT policy_version, count(*) FROM rollouts GROUP BY 1")
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from rolloutstore.io.export import export
from rolloutstore.retention.evict import evict_rows
from rolloutstore.retention.policy import RetentionConfig, RetentionReport
from rolloutstore.retention.rescore import newest_rewards, rescore
from rolloutstore.store.log import RolloutLog
from rolloutstore.store.stats import store_stats


@dataclass(frozen=True)
class EvictResult:
    rows_deleted: int
    rows_left: int
    version: int
    # Set by evict(preserve_diversity=...): coverage before/after, and what FIFO would keep.
    coverage: RetentionReport | None = None


class RolloutStore(RolloutLog):
    """A rollout store at ``uri``. Use :meth:`open`; see the module docstring."""

    def evict(
        self,
        *,
        keep_last: int | None = None,
        older_than: timedelta | datetime | None = None,
        min_policy_version: int | None = None,
        preserve_diversity: bool | RetentionConfig = False,
    ) -> EvictResult:
        """Delete rows by an explicit retention rule (sampling never deletes).

        ``keep_last``: keep the N most recent rollouts by (policy_version, created_at,
        rollout_id); ``older_than``: drop rows created before now - delta (or before a
        datetime); ``min_policy_version``: drop rows sampled by older policies.
        ``preserve_diversity`` (True or a :class:`~rolloutstore.retention.RetentionConfig`,
        with ``keep_last``): still keep exactly N rows, but spend a reserved share of them on
        older representatives of prompts, embedding clusters and correct answers the newest
        rows miss; ``coverage`` of the result reports the gain over FIFO.
        Deletions are one new version; earlier versions stay readable until compaction
        with cleanup.
        """
        self.check_writable()
        before, report = evict_rows(
            self._rollouts(), lambda: newest_rewards(self), keep_last=keep_last,
            older_than=older_than, min_policy_version=min_policy_version,
            preserve_diversity=preserve_diversity,
        )  # fmt: skip
        self._ds_cache = None
        after = self._rollouts()
        left = after.count_rows()
        return EvictResult(before - left, left, after.version, report)

    # The operations built on the log are their modules' functions (store first), bound as
    # methods: one typed signature and docstring each, never a copy or an untyped **options.
    stats = store_stats
    rescore = rescore
    export = export
