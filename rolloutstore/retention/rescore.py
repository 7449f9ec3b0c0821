"""Re-score stored rollouts when the reward changes, instead of regenerating them.

    rolloutstore-train rescore STORE --task arith [--task-option no_number_penalty=1]
                               [--where "policy_version >= ?" --param 3] [--advantage-mode grpo]

    from rolloutstore import RolloutStore
    from trainer.store_commands import task_scorer
    RolloutStore.open("runs/demo/store").rescore(task_scorer("arith"), where="reward = ?",
                                                 params=[0])

A re-scoring reads each selected rollout (``READ_COLUMNS``: ids, ``prompt_text``,
``completion_text``, ``metadata``, current ``reward``), asks a *scorer* for its new
reward, recomputes group advantages over the new rewards with an *advantage
function*, and appends one row per rollout to ``STORE/rewards.lance`` under
``reward_version`` = newest + 1 (version 0 is the reward a rollout was written with).
The rollouts dataset, and so every token column, is never rewritten.

The scorer is any callable ``score(row: dict) -> reward`` or object with such a
``score`` method; a reward is a float, a ``(float, info_dict)`` pair, or an object with
``reward`` and ``info``. The advantage function is ``advantage_fn(rewards, group_ids)
-> advantages`` (numpy arrays, one value per row). rolloutstore knows no tasks: the
trainer turns a task (by name or object) into a :class:`Scorer` that brings its verifier
and group advantages (``trainer.store_commands.task_scorer``), and its CLI
(``rolloutstore-train rescore``) re-scores by task name.

Rules:

- Advantages are group-relative, so a re-scoring always covers whole groups: ``where``
  (a filter over the ``rollouts_scored`` view, i.e. over each rollout's current reward,
  with ``?`` placeholders bound to ``params``) picks groups by any of their rows.
- Only rows whose ``task`` column equals ``from_task`` (default: the scorer's ``name``) are
  eligible, so a verifier never scores another task's rollouts.
- All rows of a re-scoring commit at once (fragments are written as it goes, then one
  Lance commit): a failure part-way leaves no partial version. A bad ``where``, an
  unknown task or a row without its answer is refused before anything is written.
- Concurrent re-scorings get distinct versions and none is lost: the version is newest + 1
  as of the rewards table version the re-scoring read, and its commit (a Lance ``Merge`` of
  the table's fragments plus the new ones, on that read version) fails when any other
  re-scoring committed since. The loser discards its fragments and runs again on the new
  newest version (``COMMIT_ATTEMPTS`` times at most, then WriteConflictError; the scorer sees
  its rows again), exactly
  as if it had started after the winner. The rewards table is created empty first (once,
  whoever wins), so the first re-scoring is no ``Overwrite`` that could replace another.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
from lance.commit import CommitConflictError
from lance.fragment import write_fragments

from rolloutstore.errors import QueryError, RescoreError
from rolloutstore.schema import spec as S
from rolloutstore.store.gc import discard_fragments
from rolloutstore.store.layout import REWARDS, exists, join, retry_conflicts

if TYPE_CHECKING:
    from rolloutstore.store.log import RolloutLog

BATCH_ROWS = 4096
READ_COLUMNS = [
    "rollout_id", "group_id", "prompt_text", "completion_text", "metadata", "reward",
]  # fmt: skip


AdvantageFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

__all__ = ["RescoreError", "RescoreResult", "Scorer", "apply_rewards", "rescore", "resolve_scorer"]


@dataclass(frozen=True)
class Scorer:
    """A resolved scorer: ``score(row)`` per rollout, the advantage function, a name, and
    ``spec`` (JSON-able) recorded with every row of the re-scoring."""

    score: Callable[[dict[str, Any]], Any]
    name: str = ""
    advantage_fn: AdvantageFn | None = None
    spec: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RescoreResult:
    rows: int
    groups: int
    reward_version: int | None  # None when nothing matched (no version was written)
    mean_before: float | None
    mean_after: float | None
    changed: int  # rows whose reward differs from the one they had before

    def line(self) -> str:
        if self.reward_version is None:
            return "rescored 0 rollouts: nothing matched; no reward version written"
        before = "-" if self.mean_before is None else f"{self.mean_before:.4f}"
        return (
            f"rescored {self.rows} rollouts in {self.groups} groups as reward_version "
            f"{self.reward_version}: mean reward {before} -> {self.mean_after:.4f}, "
            f"{self.changed} changed"
        )


def resolve_scorer(scorer: Any) -> Scorer:
    """A :class:`Scorer` from itself, a callable ``row -> reward`` or an object with
    ``score(row)``. A task (by name or object) needs the trainer's ``task_scorer``."""
    if isinstance(scorer, Scorer):
        return scorer
    name = str(getattr(scorer, "name", "") or "")
    if callable(getattr(scorer, "score", None)):
        return Scorer(scorer.score, name, None, {"scorer": type(scorer).__name__})
    if callable(scorer) and not hasattr(scorer, "reward"):
        name = name or getattr(scorer, "__name__", "")
        return Scorer(scorer, name, None, {"scorer": name})
    if isinstance(scorer, str) or hasattr(scorer, "reward"):
        raise RescoreError(
            f"cannot score with the task {scorer!r} directly: wrap it with "
            "trainer.store_commands.task_scorer(task) (the CLI: `rolloutstore-train rescore "
            "STORE --task NAME`)"
        )
    raise RescoreError(
        f"cannot score with {scorer!r}: expected a Scorer, a callable row -> reward, or an "
        "object with score(row)"
    )


def _select_sql(where: str | None) -> str:
    extra = f" AND ({where})" if where else ""
    return (
        f"WITH picked AS (SELECT DISTINCT group_id FROM rollouts_scored WHERE task = ?{extra}) "
        f"SELECT {', '.join('s.' + c for c in READ_COLUMNS)} FROM rollouts_scored s "
        "JOIN picked USING (group_id) WHERE s.task = ? ORDER BY s.group_id, s.rollout_id"
    )


def _groups(reader: pa.RecordBatchReader) -> Iterator[pa.Table]:
    """Tables of whole groups from a stream sorted by group_id (a group never splits)."""
    tail: pa.Table | None = None
    for batch in reader:
        t = pa.Table.from_batches([batch])
        if tail is not None:
            t = pa.concat_tables([tail, t])
        if t.num_rows == 0:
            continue
        gid = t["group_id"].to_numpy(zero_copy_only=False)
        last = gid[-1]
        # Rows are sorted by group_id, so the last group is a suffix: hold it back.
        cut = len(gid) - int(np.sum(gid == last))
        if cut:
            yield t.slice(0, cut)
        tail = t.slice(cut)
    if tail is not None and tail.num_rows:
        yield tail


def _reward(value: Any) -> tuple[float, Any]:
    if hasattr(value, "reward"):  # e.g. a RewardResult(reward, info)
        return float(value.reward), getattr(value, "info", {})
    if isinstance(value, tuple):
        reward, info = value
        return float(reward), info
    return float(value), {}


def _score(scorer: Scorer, advantage_fn: AdvantageFn, table: pa.Table) -> dict[str, Any]:
    rows = table.to_pylist()
    rewards, infos = [], []
    for row in rows:
        r, info = _reward(scorer.score(row))
        if not math.isfinite(r):
            raise RescoreError(f"rollout {row['rollout_id']}: the scorer returned reward {r}")
        rewards.append(r)
        infos.append(json.dumps(info, sort_keys=True, default=str))
    group_ids = table["group_id"].to_numpy(zero_copy_only=False)
    adv = np.asarray(advantage_fn(np.asarray(rewards, np.float64), group_ids), np.float32)
    if adv.shape != (len(rows),):
        raise RescoreError(
            f"advantage_fn returned shape {adv.shape} for {len(rows)} rows; expected one per row"
        )
    return {"rewards": np.asarray(rewards, np.float32), "advantages": adv, "infos": infos}


def rescore(
    store: RolloutLog,
    scorer: Any,
    *,
    advantage_fn: AdvantageFn | None = None,
    where: str | None = None,
    params: Sequence | None = None,
    from_task: str | None = None,
    note: str | None = None,
    progress: bool = False,
) -> RescoreResult:
    """Re-score ``store``'s rollouts with ``scorer``; see the module docstring.

    ``advantage_fn(rewards, group_ids)``: group advantages of the new rewards (default:
    the scorer's own, e.g. a task's group advantages).
    """
    # Check, stream every group through the scorer into uncommitted fragments, then one
    # commit (the single commit boundary stays visible here).
    store.check_writable()
    where, params = _check_filter(store, where, params)
    resolved = resolve_scorer(scorer)
    advantage_fn = advantage_fn or resolved.advantage_fn
    if advantage_fn is None:
        raise RescoreError(
            "rescore needs advantage_fn(rewards, group_ids) -> advantages for this scorer "
            "(e.g. trainer.algo.advantage.group_advantages)"
        )
    name = resolved.name
    rows_task = from_task or name
    if not rows_task:
        raise RescoreError("the scorer has no name: pass from_task to say which rows it scores")

    scorer_json = json.dumps({"task": name, **resolved.spec}, sort_keys=True, default=str)
    attempt = _Attempt(store, _select_sql(where), [rows_task, *params, rows_task], where, params)
    return retry_conflicts(
        "re-scoring",
        store.uri,
        lambda: attempt.run(resolved, advantage_fn, name, scorer_json, note, progress),
    )


@dataclass
class _Attempt:
    """One try of a re-scoring: read the newest version, score, write, commit."""

    store: RolloutLog
    sql: str
    bound: list
    where: str | None
    params: list

    def run(self, scorer: Scorer, advantage_fn: AdvantageFn, name: str, scorer_json: str,
            note: str | None, progress: bool) -> RescoreResult:  # fmt: skip
        """The result; Lance's commit conflict when another re-scoring committed first
        (nothing of this try written)."""
        from rolloutstore.query.sql import run

        store = self.store
        con = store.connect()
        try:
            total = run(con, f"SELECT count(*) AS n FROM ({self.sql})", self.bound)["n"][0]
        except QueryError as exc:
            raise RescoreError(f"--where {self.where!r} with params {self.params}: {exc}") from exc
        finally:
            con.close()
        if total.as_py() == 0:
            return RescoreResult(0, 0, None, None, None, 0)
        # The version read first: the SQL below sees it or a newer one, never an older one,
        # so a commit since (another re-scoring) always makes ours conflict.
        rewards_ds = _rewards_dataset(store)
        con = store.connect()
        bar = _bar(total.as_py(), progress)
        try:
            newest = run(con, "SELECT max(reward_version) AS v FROM rewards")["v"][0].as_py()
            version = (newest or 0) + 1
            reader = con.sql(self.sql, params=self.bound).to_arrow_reader(BATCH_ROWS)
            meta = {"version": version, "task": name, "scorer": scorer_json, "note": note}
            fragments, tally = _write_fragments(store, reader, scorer, advantage_fn, meta, bar)
        finally:
            bar.close()
            con.close()
        try:
            _commit(store, rewards_ds, fragments)
        except CommitConflictError:
            discard_fragments(store.uri, fragments, REWARDS)
            raise
        return tally.result(version)


def _rewards_dataset(store: RolloutLog) -> lance.LanceDataset:
    """The rewards table, created empty if it does not exist yet (a creation race is won by
    one process; the others open its table)."""
    target = join(store.uri, REWARDS)
    if not exists(target, store.storage_options):
        sch = S.table_schema("rewards")
        try:
            lance.write_dataset(sch.empty_table(), target, schema=sch, mode="create",
                                storage_options=store.storage_options)  # fmt: skip
        except (OSError, ValueError):
            if not exists(target, store.storage_options):
                raise
    return lance.dataset(target, storage_options=store.storage_options)


def _check_filter(
    store: RolloutLog, where: str | None, params: Sequence | None
) -> tuple[str | None, list]:
    """``where`` checked (a filter over ``rollouts_scored``) and its ``params`` as a list."""
    from rolloutstore.query.sql import check_where

    if where is not None:
        columns = [*store.schema.names, "reward_version"]
        where = check_where(where, columns, n_params=len(params or []))
    params = list(params or [])
    if where is None and params:
        raise RescoreError(f"{len(params)} --param value(s) given without --where")
    return where, params


@dataclass
class _Tally:
    """Running totals of a re-scoring, for its :class:`RescoreResult`."""

    rows: int = 0
    groups: int = 0
    changed: int = 0
    sum_before: float = 0.0
    n_before: int = 0
    sum_after: float = 0.0

    def add(self, part: pa.Table, new: np.ndarray) -> None:
        """Count the scored ``part`` whose new rewards are ``new``."""
        old = part["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
        known = ~np.isnan(old)
        self.sum_before += float(old[known].sum())
        self.n_before += int(known.sum())
        self.sum_after += float(new.astype(np.float64).sum())
        self.changed += int(np.sum(~known | (old != new)))
        self.rows += part.num_rows
        self.groups += len(set(part["group_id"].to_pylist()))

    def result(self, version: int) -> RescoreResult:
        return RescoreResult(
            rows=self.rows,
            groups=self.groups,
            reward_version=version,
            mean_before=self.sum_before / self.n_before if self.n_before else None,
            mean_after=self.sum_after / self.rows,
            changed=self.changed,
        )


def _write_fragments(
    store: RolloutLog,
    reader: pa.RecordBatchReader,
    scorer: Scorer,
    advantage_fn: AdvantageFn,
    meta: dict[str, Any],
    bar,
) -> tuple[list, _Tally]:
    """Score every group ``reader`` yields and write its rows under ``meta["version"]`` as
    uncommitted fragments of the rewards table; returns them and the totals."""
    sch = S.table_schema("rewards")
    target = join(store.uri, REWARDS)
    now = datetime.now(UTC)
    fragments: list = []
    tally = _Tally()
    for part in _groups(reader):
        scored = _score(scorer, advantage_fn, part)
        tally.add(part, scored["rewards"])
        table = _version_rows(part, scored, sch, created_at=now, **meta)
        fragments += write_fragments(
            table, target, schema=sch, storage_options=store.storage_options
        )
        bar.update(part.num_rows)
    return fragments, tally


def _commit(store: RolloutLog, rewards_ds: lance.LanceDataset, fragments: list) -> None:
    """One commit for the whole re-scoring: until here nothing is visible. A ``Merge`` (the
    table's fragments plus ours) on the version read conflicts with any commit since, where
    two ``Append``s would both succeed; raises CommitConflictError then."""
    old = [f.metadata for f in rewards_ds.get_fragments()]
    with warnings.catch_warnings():  # a pyarrow schema: the one the table was created with
        warnings.simplefilter("ignore", DeprecationWarning)
        op = lance.LanceOperation.Merge(old + fragments, S.table_schema("rewards"))
    lance.LanceDataset.commit(
        rewards_ds.uri, op, read_version=rewards_ds.version, storage_options=store.storage_options
    )


def _version_rows(
    part: pa.Table, scored: dict[str, Any], sch: pa.Schema, *, created_at, version: int,
    task: str, scorer: str, note: str | None,
) -> pa.Table:  # fmt: skip
    """The rewards-table rows of one scored part under ``version``."""
    n = part.num_rows
    return pa.table(
        {
            "rollout_id": part["rollout_id"],
            "reward_version": pa.array(np.full(n, version, np.int64)),
            "reward": pa.array(scored["rewards"], pa.float32()),
            "advantage": pa.array(scored["advantages"], pa.float32()),
            "reward_info": pa.array(scored["infos"], pa.string()),
            "task": pa.array([task] * n, pa.string()),
            "scorer": pa.array([scorer] * n, pa.string()),
            "note": pa.array([note] * n, pa.string()),
            "created_at": pa.array([created_at] * n, sch.field("created_at").type),
        },
        schema=sch,
    )


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="rollout", desc="rescore", disable=not enabled)


def apply_rewards(t: pa.Table, overlay: pa.Table | None) -> pa.Table:
    """``t`` with reward/advantage replaced where ``overlay`` has the rollout, plus
    a ``reward_version`` column (0: the values the rollout was written with)."""
    n = t.num_rows
    if overlay is None or n == 0:
        return t.append_column("reward_version", pa.array(np.zeros(n, np.int64)))
    pos = pa.compute.index_in(t["rollout_id"], value_set=overlay["rollout_id"])
    hit = pos.is_valid()
    cols = {}
    for name in ("reward", "advantage"):
        if name not in t.column_names:
            continue
        new = overlay[name].take(pos).cast(t.schema.field(name).type)
        cols[name] = pa.compute.if_else(hit, new, t[name])
    version = pa.compute.if_else(hit, overlay["reward_version"].take(pos), pa.scalar(0, pa.int64()))
    for name, col in cols.items():
        t = t.set_column(t.schema.get_field_index(name), name, col)
    return t.append_column("reward_version", version)


def newest_rewards(store: RolloutLog) -> pa.Table | None:
    """Each re-scored rollout's newest (rollout_id, reward_version, reward, advantage), or None."""
    from rolloutstore.query.sql import REWARDS_NEWEST_SQL

    rewards = store.rewards_table()
    if not isinstance(rewards, lance.LanceDataset):
        return None
    t = store.sql(REWARDS_NEWEST_SQL.format(where=""))
    return t if t.num_rows else None
