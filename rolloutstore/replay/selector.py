"""``Selector``: draws replay batches from the store with DuckDB SQL and a seeded sampler.

Cost grows with the window, not the store. The selector keeps per-fragment
bounds of ``policy_version`` (fragments are immutable, so each is read once) and
scans only the fragments that can hold the window: newest versions first, adding
fragments until the N-th newest eligible row provably beats every row left
out. Only scalar columns are read; token columns are never touched here.

Sampling is a pure function of (seed, step, store version, config): the
candidates come back in a total order and the draw uses
``numpy.random.default_rng([seed, step])``. For ``max_uses`` the selector counts
this run's own draws in memory (seeded from the usage log at the step it starts
or resumes from, counting only earlier steps) plus other runs' logged uses, so a
resumed run, or a loader worker replaying the selections, sees exactly what the
uninterrupted run saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from ..errors import RolloutStoreError
from ..sql import connect, run
from ..store import RolloutStore
from .config import ReplayConfig
from .queries import (
    SCALAR_COLUMNS,
    SELECT_COLUMNS,
    USES_FILTER_SQL,
    lance_filter,
    window_sql,
)


class EmptyBufferError(RolloutStoreError, LookupError):
    """No rollout is eligible under the replay config."""


@dataclass(frozen=True)
class Selection:
    """One drawn batch: row addresses in the store version it was drawn from, and per-row data."""

    row_addresses: np.ndarray  # (B,) uint64, Lance row addresses at store_version
    rollout_ids: list[str]
    weights: np.ndarray  # (B,) float32 importance weights (1 for uniform sampling)
    staleness: np.ndarray  # (B,) int64, learner_version - policy_version
    policy_version: np.ndarray  # (B,) int64
    prompt_ids: list[str] = field(repr=False)
    run_ids: list[str] = field(default=None, repr=False)
    learner_version: int = 0
    store_version: int = 0
    step: int = 0
    # The buffer this batch was drawn from: lets a loader read (and cache) it in one pass.
    buffer_addresses: np.ndarray = field(default=None, repr=False)
    buffer_tokens: int = 0

    def __len__(self) -> int:
        return len(self.rollout_ids)


@dataclass
class _FragStats:
    """Live row counts of one fragment by (run_id, policy_version)."""

    runs: np.ndarray  # object
    pv: np.ndarray  # int64
    rows: np.ndarray  # int64

    def eligible(self, runs: tuple[str, ...] | None, lower: int | None) -> np.ndarray:
        keep = np.ones(len(self.pv), bool)
        if runs is not None:
            keep &= np.isin(self.runs, list(runs))
        if lower is not None:
            keep &= self.pv >= lower
        return keep


class Selector:
    """Draw batches from ``store`` under ``config``; see the module docstring."""

    def __init__(
        self,
        store: RolloutStore,
        config: ReplayConfig | None = None,
        *,
        run_id: str = "default",
        record_usage: bool = True,
    ):
        self.store = store
        self.config = config or ReplayConfig()
        self.run_id = run_id
        self.record_usage = record_usage
        self.step = 0
        self._frag_stats: dict[tuple, _FragStats] = {}
        self._own_uses: dict[str, int] | None = None
        self._con = None
        self._con_pid = None
        self._buf_cache: tuple | None = None
        self._codes_cache: tuple | None = None
        self._usage_seen: set[int] = set()
        self._others: dict[str, set] = {}
        self._last_sql: str | None = None
        self._last_filter: str | None = None

    def _sql(self, tables: dict[str, Any], query: str, params: list | None = None) -> pa.Table:
        """Run ``query`` on this selector's one DuckDB connection with ``tables`` registered."""
        import os

        if self._con is None or self._con_pid != os.getpid():
            # One locked connection per selector (and per process): opening one costs ~20 ms.
            self._con, self._con_pid = connect({}), os.getpid()
        for name, table in tables.items():
            self._con.register(name, table)
        return run(self._con, query, params or None)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_con"] = None
        state["_buf_cache"] = None
        state["_codes_cache"] = None
        return state

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.config.seed, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._own_uses = None  # re-read from the usage log, up to the new step

    def explain(self, learner_version: int | None = None) -> str:
        """The SQL the selector runs, and the filter it pushes into the Lance scan.

        With ``learner_version`` the scan filter is computed for real (it reads the
        per-fragment version counts); without it, only the staleness-free part is shown.
        """
        sql = window_sql(self.config)
        if self.config.max_uses is not None:
            sql += f";\n-- reuse cap (buf = the result above):\n{USES_FILTER_SQL}"
        if learner_version is not None:
            self.candidates(learner_version)
            scan = self._last_filter or "(none)"
        else:
            scan = lance_filter(self.config, None) or "(none)"
        return (
            f"-- Lance scan of the fragments that can hold the window, columns: "
            f"{', '.join(SCALAR_COLUMNS)}\n-- pushed-down filter: {scan}\n"
            "-- cand = the scanned rows; uses = per rollout, this run's draws at earlier steps\n"
            "-- (counted in memory) plus other runs' distinct (run, step) uses from the usage log\n"
            f"{sql}"
        )

    # -- candidates --------------------------------------------------------------------
    def _lower(self, learner_version: int | None) -> int | None:
        if self.config.max_staleness is None or learner_version is None:
            return None
        return learner_version - self.config.max_staleness

    def _stats(self, frag) -> _FragStats:
        # Fragment ids are never reused and our rows are never updated in place, so a
        # fragment's content changes only through deletions.
        key = (frag.fragment_id, frag.num_deletions)
        st = self._frag_stats.get(key)
        if st is None:
            t = frag.to_table(columns=["run_id", "policy_version"])
            g = t.group_by(["run_id", "policy_version"]).aggregate([("policy_version", "count")])
            st = _FragStats(
                np.asarray(g["run_id"].to_pylist(), dtype=object),
                g["policy_version"].to_numpy().astype(np.int64),
                g["policy_version_count"].to_numpy().astype(np.int64),
            )
            self._frag_stats[key] = st
        return st

    def candidates(self, learner_version: int) -> pa.Table:
        """The buffer after window, staleness, use cap and group filters (scalar columns)."""
        buf = self.buffer(learner_version)
        if self.config.max_uses is None:
            return buf
        return self._sql(
            {"buf": buf, "uses": self._use_counts(buf)}, USES_FILTER_SQL, [self.config.max_uses]
        )

    def buffer(self, learner_version: int) -> pa.Table:
        """Window, staleness and group filters; cached per (store version, staleness bound)."""
        ds = self.store.dataset()
        lower = self._lower(learner_version)
        key = (ds.version, lower)
        if self._buf_cache is not None and self._buf_cache[0] == key:
            return self._buf_cache[1]
        buf = self._buffer(ds, lower)
        self._buf_cache = (key, buf)
        return buf

    def _buffer(self, ds, lower: int | None) -> pa.Table:
        cfg = self.config
        frags = []
        for f in ds.get_fragments():
            st = self._stats(f)
            keep = st.eligible(cfg.runs, lower)
            if keep.any():
                frags.append((f, st.pv[keep], st.rows[keep]))
        sql = window_sql(cfg)
        params: list = list(cfg.where_params)
        self._last_sql = sql
        if cfg.window is None or cfg.where is None:
            # Counts by version are exact for every filter but `where`: the window's
            # oldest version is known before reading a row, and only it and newer are read.
            bound = lower
            if cfg.window is not None and frags:
                pv = np.concatenate([p for _, p, _ in frags])
                rows = np.concatenate([r for _, _, r in frags])
                order = np.argsort(-pv, kind="stable")
                reach = np.cumsum(rows[order])
                i = int(np.searchsorted(reach, cfg.window))
                if i < len(order):
                    bound = max(int(pv[order][i]), lower if lower is not None else -(2**62))
            scan = [f for f, p, _ in frags if bound is None or p.max() >= bound]
            scan_filter = lance_filter(cfg, bound)
            self._last_filter = scan_filter
            return self._window(self._scan(ds, scan, scan_filter), sql, params)
        return self._window(self._scan_for_where(ds, frags, lower), sql, params)

    def _scan_for_where(self, ds, frags, lower) -> pa.Table:
        """With a `where` filter eligibility is unknown until rows are read: widen newest-first."""
        cfg = self.config
        frags = sorted(frags, key=lambda x: (int(x[1].max()), x[0].fragment_id), reverse=True)
        scan_filter = lance_filter(cfg, lower)
        self._last_filter = scan_filter
        chosen, need = 0, cfg.window
        while True:
            total = 0
            for i, (_, _, r) in enumerate(frags):
                total += int(r.sum())
                if i + 1 > chosen and total >= need:
                    chosen = i + 1
                    break
            else:
                chosen = len(frags)
            cand = self._scan(ds, [f for f, _, _ in frags[:chosen]], scan_filter)
            if chosen >= len(frags):
                return cand
            n_eligible, nth_pv = self._eligible_count_and_nth(cand, list(cfg.where_params))
            if n_eligible >= cfg.window:
                # Safe once no unread fragment can hold a row at or above the N-th version.
                more = sum(1 for _, p, _ in frags[chosen:] if p.max() >= nth_pv)
                if more == 0:
                    return cand
                need = total + sum(int(r.sum()) for _, p, r in frags[chosen:] if p.max() >= nth_pv)
            else:
                need = max(need * 2, total + 1)

    def _scan(self, ds, fragments, scan_filter) -> pa.Table:
        # A `where` may name any scalar column; otherwise read only what selection uses.
        cols = SCALAR_COLUMNS if self.config.where else SELECT_COLUMNS
        cols = cols + (["embedding"] if self.config.diversity == "embedding" else [])
        if not fragments:
            return (
                ds.schema.empty_table()
                .select(cols)
                .append_column("_rowaddr", pa.array([], pa.uint64()))
            )
        return ds.scanner(
            columns=cols, filter=scan_filter, fragments=fragments, with_row_address=True
        ).to_table()

    def _eligible_count_and_nth(self, cand: pa.Table, params_where: list) -> tuple[int, int]:
        where = f"WHERE ({self.config.where})" if self.config.where else ""
        t = self._sql(
            {"cand": cand},
            f"SELECT policy_version FROM cand {where} ORDER BY policy_version DESC "
            f"LIMIT 1 OFFSET {int(self.config.window) - 1}",
            params_where,
        )
        n = self._sql({}, f"SELECT count(*) AS n FROM cand {where}", params_where)
        nth = t["policy_version"][0].as_py() if t.num_rows else -(2**62)
        return int(n["n"][0].as_py()), nth

    def _window(self, cand: pa.Table, sql: str, params: list) -> pa.Table:
        return self._sql({"cand": cand}, sql, params)

    def _use_counts(self, buf: pa.Table) -> pa.Table:
        """Use counts of the buffer's rollouts: this run's (in memory) plus other runs'."""
        usage = self.store._usage()
        if self._own_uses is None:
            own = self._sql(
                {"usage": usage},
                "SELECT rollout_id, count(DISTINCT learner_step) AS n FROM usage "
                "WHERE run_id = ? AND learner_step < ? GROUP BY 1",
                [self.run_id, self.step],
            )
            self._own_uses = dict(zip(own["rollout_id"].to_pylist(), own["n"].to_pylist()))
        others = self._other_uses(usage)
        ids = buf["rollout_id"].to_pylist()
        counts = [self._own_uses.get(r, 0) + len(others.get(r, ())) for r in ids]
        return pa.table(
            {"rollout_id": pa.array(ids, pa.string()), "n": pa.array(counts, pa.int64())}
        )

    def _other_uses(self, usage) -> dict[str, set]:
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
            own = self.run_id.replace("'", "''")
            t = usage.scanner(
                columns=["rollout_id", "run_id", "learner_step"],
                fragments=new,
                filter=f"run_id <> '{own}'",
            ).to_table()
            for rid, run_id, step in zip(
                t["rollout_id"].to_pylist(), t["run_id"].to_pylist(), t["learner_step"].to_pylist()
            ):
                self._others.setdefault(rid, set()).add((run_id, step))
            self._usage_seen |= {f.fragment_id for f in new}
        return self._others

    # -- sampling ----------------------------------------------------------------------
    def sample(
        self,
        batch_size: int | None,
        learner_version: int,
        *,
        max_tokens: int | None = None,
        learner_step: int | None = None,
    ) -> Selection:
        """Draw one batch for a learner at ``learner_version``; records usage; advances the step.

        ``max_tokens``: fill the batch up to this many (prompt + completion) tokens
        instead of (or as well as) ``batch_size`` rows; at least one row is returned.
        """
        if batch_size is None and max_tokens is None:
            raise ValueError("sample needs batch_size or max_tokens")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        step = self.step if learner_step is None else learner_step
        if step != self.step:
            self._own_uses = None
        self.step = step
        store_version = self.store.version
        cand = self.candidates(learner_version)
        if cand.num_rows == 0:
            raise EmptyBufferError(
                f"no eligible rollouts for learner_version {learner_version} under {self.config} "
                f"(store version {store_version}, {self.store.count()} rows); wait for actors "
                "or relax window/max_staleness/max_uses/where"
            )
        rng = np.random.default_rng([self.config.seed, step])
        want = batch_size if batch_size is not None else cand.num_rows
        if self._codes_cache is None or self._codes_cache[0] is not cand:
            self._codes_cache = (cand, _codes(cand["prompt_id"]))
        idx, weights = _draw(
            cand, want, self.config, rng, self._embeddings, prompts=self._codes_cache[1]
        )
        if max_tokens is not None:
            lengths = (
                cand["num_prompt_tokens"].to_numpy().astype(np.int64)
                + cand["num_completion_tokens"].to_numpy().astype(np.int64)
            )[idx]
            keep = max(1, int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right")))
            idx, weights = idx[:keep], weights[:keep]
        pick = cand.take(pa.array(idx, pa.int64()))
        pv = pick["policy_version"].to_numpy().astype(np.int64)
        sel = Selection(
            row_addresses=pick["_rowaddr"].to_numpy().astype(np.uint64),
            rollout_ids=pick["rollout_id"].to_pylist(),
            weights=weights.astype(np.float32),
            staleness=(learner_version - pv).astype(np.int64),
            policy_version=pv,
            prompt_ids=pick["prompt_id"].to_pylist(),
            run_ids=pick["run_id"].to_pylist(),
            learner_version=learner_version,
            store_version=store_version,
            step=step,
            buffer_addresses=cand["_rowaddr"].to_numpy().astype(np.uint64),
            buffer_tokens=int(pa.compute.sum(cand["num_prompt_tokens"]).as_py() or 0)
            + int(pa.compute.sum(cand["num_completion_tokens"]).as_py() or 0),
        )
        if self._own_uses is not None:
            for rid in set(sel.rollout_ids):
                self._own_uses[rid] = self._own_uses.get(rid, 0) + 1
        if self.record_usage:
            self.store.record_usage(sel.rollout_ids, learner_step=step, run_id=self.run_id)
        self.step = step + 1
        return sel

    def _embeddings(self, cand: pa.Table, idx: np.ndarray) -> np.ndarray:
        emb = cand["embedding"].take(pa.array(idx, pa.int64()))
        dim = self.store.embedding_dim
        out = np.zeros((len(idx), dim), np.float32)
        valid = ~emb.is_null().to_numpy(zero_copy_only=False)
        if valid.any():
            flat = emb.filter(pa.array(valid)).combine_chunks().values.to_numpy()
            out[valid] = flat.reshape(-1, dim)
        return out


# -- the draw (pure numpy) --------------------------------------------------------------
def _gumbel_order(logp: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random order that is sampling without replacement with probabilities ~ exp(logp)."""
    keys = logp + rng.gumbel(size=len(logp))
    return np.argsort(-keys, kind="stable")


def _take_in_order(order, n, prompts, cap, taken_prompts) -> np.ndarray:
    """The first ``n`` of ``order``, skipping rows whose prompt already has ``cap`` picks."""
    if cap is None:
        return np.asarray(order[:n], dtype=np.int64)
    out = []
    for i in order:
        if len(out) >= n:
            break
        p = prompts[i]
        if taken_prompts.get(p, 0) >= cap:
            continue
        taken_prompts[p] = taken_prompts.get(p, 0) + 1
        out.append(int(i))
    return np.asarray(out, dtype=np.int64)


def _draw(cand: pa.Table, batch_size: int, cfg: ReplayConfig, rng, embeddings, prompts=None):
    n = cand.num_rows
    prompts = _codes(cand["prompt_id"]) if prompts is None else prompts
    reward = cand["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
    adv = np.nan_to_num(cand["advantage"].to_numpy(zero_copy_only=False).astype(np.float64))
    if cfg.whole_groups:
        return _draw_groups(cand, batch_size, cfg, rng, adv)

    logp = np.zeros(n)
    if cfg.priority == "advantage":
        logp = cfg.alpha * np.log(np.abs(adv) + cfg.priority_eps)
    probs = np.exp(logp - logp.max())
    probs /= probs.sum()
    weights_all = (n * probs) ** (-cfg.beta) if cfg.priority == "advantage" else np.ones(n)
    if cfg.priority == "advantage":
        weights_all = weights_all / weights_all.max()

    taken: dict = {}
    chosen = np.zeros(0, np.int64)
    k_pos = int(round(cfg.positive_fraction * batch_size))
    if k_pos:
        # Candidates are newest first, so the first positives are the freshest.
        pos = np.flatnonzero(np.nan_to_num(reward, nan=-np.inf) > cfg.positive_threshold)
        pool = pos[: cfg.positive_pool]
        if len(pool):
            order = pool[_gumbel_order(np.zeros(len(pool)), rng)]
            if cfg.replacement:
                order = rng.choice(pool, size=k_pos * 4)
            chosen = _take_in_order(order, k_pos, prompts, cfg.per_prompt_cap, taken)
    rest = batch_size - len(chosen)
    remaining = np.arange(n)
    if len(chosen) and not cfg.replacement:
        remaining = np.setdiff1d(remaining, chosen)

    if cfg.diversity == "prompt":
        order = _prompt_round_robin(remaining, prompts, logp, rng)
    elif cfg.diversity == "embedding":
        pool_n = min(len(remaining), cfg.diversity_pool * max(rest, 1))
        pool = remaining[_gumbel_order(logp[remaining], rng)[:pool_n]]
        order = pool[_farthest_point(embeddings(cand, pool), rest, rng)]
    elif cfg.replacement:
        p = probs[remaining] / probs[remaining].sum()
        order = rng.choice(remaining, size=rest * 4 + 16, p=p)
    else:
        order = remaining[_gumbel_order(logp[remaining], rng)]
    rest_idx = _take_in_order(order, rest, prompts, cfg.per_prompt_cap, taken)
    idx = np.concatenate([chosen, rest_idx])
    w = np.ones(len(idx)) if not len(idx) else weights_all[idx]
    if k_pos:
        w[: min(k_pos, len(idx))] = 1.0
    return idx, w


def _codes(col: pa.ChunkedArray) -> np.ndarray:
    """Integer codes of a string column (equal strings, equal codes)."""
    enc = col.combine_chunks().dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _prompt_round_robin(rows: np.ndarray, prompts: np.ndarray, logp, rng) -> np.ndarray:
    """Rows ordered so that consecutive picks cycle over prompts in random order."""
    order = rows[_gumbel_order(logp[rows], rng)]
    codes = prompts[order]
    n = len(order)
    # Occurrence rank of each row within its prompt, and each prompt's first position.
    by_code = np.argsort(codes, kind="stable")
    sorted_codes = codes[by_code]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_codes)) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    rank = np.empty(n, np.int64)
    rank[by_code] = np.arange(n) - group_start
    first = np.empty(n, np.int64)
    first[by_code] = by_code[group_start]
    return order[np.argsort(rank * (n + 1) + first, kind="stable")]


def _farthest_point(x: np.ndarray, k: int, rng) -> np.ndarray:
    """Greedy farthest-point sampling: ``k`` indices of ``x`` (N, D) covering its spread."""
    n = len(x)
    if n == 0:
        return np.zeros(0, np.int64)
    k = min(k, n)
    first = int(rng.integers(n))
    picked = [first]
    d = np.linalg.norm(x - x[first], axis=1)
    for _ in range(k - 1):
        nxt = int(np.argmax(d))
        picked.append(nxt)
        d = np.minimum(d, np.linalg.norm(x - x[nxt], axis=1))
    return np.asarray(picked, np.int64)


def _draw_groups(cand: pa.Table, batch_size: int, cfg: ReplayConfig, rng, adv):
    groups = _codes(cand["group_id"])
    uniq, first_idx, inverse = np.unique(groups, return_index=True, return_inverse=True)
    # Keep the candidates' (newest-first) order among groups.
    by_age = np.argsort(first_idx, kind="stable")
    sizes = np.bincount(inverse, minlength=len(uniq))
    logp = np.zeros(len(uniq))
    if cfg.priority == "advantage":
        mean_abs = np.bincount(inverse, weights=np.abs(adv), minlength=len(uniq)) / sizes
        logp = cfg.alpha * np.log(mean_abs + cfg.priority_eps)
    order = by_age[_gumbel_order(logp[by_age], rng)]
    picked, rows = [], 0
    for g in order:
        if rows >= batch_size:
            break
        picked.append(g)
        rows += sizes[g]
    idx = np.concatenate([np.flatnonzero(inverse == g) for g in picked]).astype(np.int64)
    return idx, np.ones(len(idx))
