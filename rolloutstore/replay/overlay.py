"""Re-scored rewards in replay: the rewards a selector overlays on the rows it scans, each
rollout's newest re-scoring (or, with ``ReplayConfig.reward_version=k``, its newest at or
below k; 0: as written), cached per version of the rewards table."""

from __future__ import annotations

from collections.abc import Callable

import lance
import pyarrow as pa

from rolloutstore.errors import RewardVersionError
from rolloutstore.facade import RolloutStore
from rolloutstore.query.sql import REWARDS_NEWEST_SQL

Sql = Callable[..., pa.Table]  # (tables, query, params) -> result, on the selector's connection


class RewardOverlay:
    """The rewards table of a store as a selector reads it; see the module docstring."""

    def __init__(self) -> None:
        self._rewards_ds: lance.LanceDataset | None = None
        self._overlay_cache: tuple | None = None

    def version(self, store: RolloutStore) -> int | None:
        """Version of the rewards table (None: no re-scoring yet); cheap, read every draw."""
        if self._rewards_ds is None:
            ds = store.rewards_table()
            if not isinstance(ds, lance.LanceDataset):
                return None
            self._rewards_ds = ds
        return self._rewards_ds.latest_version

    def table(self, store: RolloutStore, sql: Sql, want: int | None) -> pa.Table | None:
        """(rollout_id, reward, advantage, reward_version) of the chosen re-scoring per rollout
        (``want``: the config's ``reward_version``); None when there is none."""
        version = self.version(store)
        if self._overlay_cache is not None and self._overlay_cache[0] == version:
            return self._overlay_cache[1]
        table = None
        if version is not None:
            ds = self._rewards_ds.checkout_version(version)
            newest = sql({"rewards": ds}, "SELECT max(reward_version) AS v FROM rewards")
            top = newest["v"][0].as_py() or 0
            if want is not None and want > top:
                raise RewardVersionError(
                    f"ReplayConfig.reward_version {want} does not exist: the store's "
                    f"re-scorings go up to {top} (0 = the rewards rollouts were written with)"
                )
            where = "" if want is None else "WHERE reward_version <= ?"
            table = sql(
                {"rewards": ds},
                REWARDS_NEWEST_SQL.format(where=where),
                None if want is None else [want],
            )
            table = table if table.num_rows else None
        elif want not in (None, 0):
            raise RewardVersionError(
                f"ReplayConfig.reward_version {want} does not exist: the store has no "
                "re-scorings yet (run `rolloutstore-train rescore`), only version 0"
            )
        self._overlay_cache = (version, table)
        return table
