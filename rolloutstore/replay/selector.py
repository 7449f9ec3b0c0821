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

Re-scored rewards (``rolloutstore-train rescore``) are overlaid on the scanned rows before
the window SQL, so ``drop_zero_variance_groups``, ``positive_fraction``, advantage
priority and ``where`` all read the chosen reward version: each rollout's newest by
default, or with ``reward_version=k`` its newest re-scoring at or below k (0: the
values it was written with). The overlay is cached per rewards-table version, the
buffer per (store version, staleness bound, rewards version); ``Selection`` carries
the overlaid ``rewards``/``advantages`` for the loader.

Fresh/replay mix (``fresh_fraction`` f > 0): within the candidates, the fresh rows
are those whose policy_version is among the ``fresh_versions`` highest present. The
batch is a stratified draw: round(f * B) rows from the fresh rows and the rest from
the others, each side with the configured rules (positive_fraction, priority,
diversity, replacement) applied within it and ``per_prompt_cap`` shared across
both. A side with too few rows is topped up from the other side. The two sides are
interleaved at the share f, so any prefix (``max_tokens`` keeps a prefix) holds it
too until a side runs out. With ``whole_groups`` the quota is counted in rows and filled group
by group (a group is fresh if its newest row is). Importance weights correct only
the priority sampling within a side, ``w = (N_s P_s(i))^-beta`` normalised by the
max over both sides, so uniform priority keeps w = 1: the mix, like
``positive_fraction``, is a deliberate target distribution, not a bias to undo.

Without ``replacement`` a batch never holds a row twice, whatever the diversity mode.
Embedding diversity (farthest-point over a priority-drawn pool) places only rows with an
embedding; the pool's rows without one (imported rows) are drawn with prompt diversity and
interleaved at their share of the pool; ``Selection.no_embedding`` counts them and the
first such draw warns (``MissingEmbeddingWarning``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from rolloutstore.errors import (
    EmptyBufferError,
    MissingEmbeddingWarning,
    RewardVersionError,
    RowOverBudgetWarning,
    ShortBatchWarning,
    ShrunkBatchWarning,
)
from rolloutstore.facade import RolloutStore
from rolloutstore.query.sql import connect, run
from rolloutstore.replay.budget import fit_budget, over_budget, over_budget_message, row_lengths
from rolloutstore.replay.config import SCALAR_COLUMNS, SELECT_COLUMNS, ReplayConfig
from rolloutstore.replay.draw import codes, draw, fresh_mask
from rolloutstore.replay.overlay import RewardOverlay
from rolloutstore.replay.queries import USES_FILTER_SQL, lance_filter, window_sql
from rolloutstore.replay.selection import Selection, selection_of
from rolloutstore.replay.uses import UseCounts
from rolloutstore.retention.rescore import apply_rewards
from rolloutstore.schema.compat import present, read_columns

__all__ = [
    "EmptyBufferError",
    "MissingEmbeddingWarning",
    "RewardVersionError",
    "RowOverBudgetWarning",
    "Selection",
    "Selector",
    "ShortBatchWarning",
    "ShrunkBatchWarning",
]


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
        self.config = (config or ReplayConfig()).seeded()
        self.run_id = run_id
        self.record_usage = record_usage
        # Steps of this run whose usage is already in the log (a resumed run retakes steps
        # its killed predecessor recorded): not recorded again, so the log holds each once.
        self.usage_recorded_through = -1
        self.step = 0
        self._frag_stats: dict[tuple, _FragStats] = {}
        self._uses = UseCounts()
        self._con = None
        self._con_pid = None
        self._buf_cache: tuple | None = None
        self._codes_cache: tuple | None = None
        self._last_sql: str | None = None
        self._last_filter: str | None = None
        self._rewards = RewardOverlay()
        self._warned_no_embedding = False
        self._warned_budget = {"over": False, "cut": False}
        self._budget_cache: tuple | None = None

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
        state["_rewards"] = RewardOverlay()
        return state

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.config.seed, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._uses.forget_own()  # re-read from the usage log, up to the new step

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
        k = self.config.reward_version
        overlay = (
            "each rollout's newest re-scoring (rewards table), else as written"
            if k is None
            else f"each rollout's newest re-scoring with reward_version <= {k}, else as written"
        )
        return (
            f"-- Lance scan of the fragments that can hold the window, columns: "
            f"{', '.join(SCALAR_COLUMNS)}\n-- pushed-down filter: {scan}\n"
            "-- cand = the scanned rows; uses = per rollout, this run's draws at earlier steps\n"
            "-- (counted in memory) plus other runs' distinct (run, step) uses from the usage log\n"
            f"-- reward, advantage: {overlay}\n"
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
        uses = self._uses.table(self._sql, self.store.usage_dataset(), buf, self.run_id, self.step)
        return self._sql({"buf": buf, "uses": uses}, USES_FILTER_SQL, [self.config.max_uses])

    def buffer(self, learner_version: int) -> pa.Table:
        """Window, staleness and group filters; cached per (store version, staleness bound)."""
        ds = self.store.dataset()
        lower = self._lower(learner_version)
        key = (ds.version, lower, self._rewards.version(self.store))
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
            t = (
                self.store.schema.empty_table()
                .select(cols)
                .append_column("_rowaddr", pa.array([], pa.uint64()))
            )
        else:
            t = ds.scanner(
                columns=read_columns(cols, ds.schema),
                filter=scan_filter,
                fragments=fragments,
                with_row_address=True,
            ).to_table()
            t = present(t, cols, self.store.schema)  # a v1 store's rows as one model turn
        return apply_rewards(
            t, self._rewards.table(self.store, self._sql, self.config.reward_version)
        )

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
        instead of (or as well as) ``batch_size`` rows; rows longer than it are not drawn
        (rolloutstore/replay/budget.py: counted in ``over_budget``, the rows it cuts off a
        ``batch_size`` draw in ``budget_cut``; each warns once); at least one row is returned.
        """
        if batch_size is None and max_tokens is None:
            raise ValueError("sample needs batch_size or max_tokens")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        step = self.step if learner_step is None else learner_step
        if step != self.step:
            self._uses.forget_own()
        self.step = step
        store_version = self.store.version
        cand = self.candidates(learner_version)
        if cand.num_rows == 0:
            raise EmptyBufferError(
                f"no eligible rollouts for learner_version {learner_version} under {self.config} "
                f"(store version {store_version}, {self.store.count()} rows); wait for actors "
                "or relax window/max_staleness/max_uses/where"
            )
        over = None
        if max_tokens is not None:
            cand, over = self._within_budget(cand, max_tokens)
        idx, weights, fresh, cut = self._draw(cand, batch_size, max_tokens, step)
        no_embedding = self._no_embedding(cand, idx)
        sel = selection_of(
            cand,
            idx,
            weights,
            fresh,
            learner_version=learner_version,
            store_version=store_version,
            step=step,
            requested=batch_size,
            no_embedding=no_embedding,
            over_budget=over,
            budget_cut=cut,
        )
        self._uses.add_own(sel.rollout_ids)
        if self.record_usage and step > self.usage_recorded_through:
            self.store.record_usage(sel.rollout_ids, learner_step=step, run_id=self.run_id)
        self.step = step + 1
        return sel

    def _within_budget(self, cand: pa.Table, max_tokens: int) -> tuple[pa.Table, int]:
        """(the candidates a ``max_tokens`` batch can hold, how many it cannot); the first
        selector draw that leaves rows out warns (RowOverBudgetWarning)."""
        c = self._budget_cache
        if c is not None and c[0] is cand and c[1] == max_tokens:
            return c[2], c[3]
        over = over_budget(cand, max_tokens)
        n = int(over.sum())
        kept = cand.filter(pa.array(~over)) if n else cand
        if n and not self._warned_budget["over"]:
            self._warned_budget["over"] = True
            warnings.warn(
                over_budget_message(cand, over, max_tokens), RowOverBudgetWarning, stacklevel=3
            )
        self._budget_cache = (cand, max_tokens, kept, n)
        return kept, n

    def _draw(
        self, cand: pa.Table, batch_size: int | None, max_tokens: int | None, step: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
        """(candidate indices, importance weights, every candidate's fresh mask, rows the token
        budget cut off a ``batch_size`` draw) of the draw at ``step``; warns
        (ShortBatchWarning) when fewer than ``batch_size`` rows come, and once per selector
        (ShrunkBatchWarning) when the budget cuts rows."""
        rng = np.random.default_rng([self.config.seed, step])
        want = batch_size if batch_size is not None else cand.num_rows
        if self._codes_cache is None or self._codes_cache[0] is not cand:
            pv_all = cand["policy_version"].to_numpy().astype(np.int64)
            self._codes_cache = (
                cand,
                codes(cand["prompt_id"]),
                fresh_mask(pv_all, self.config.fresh_versions),
                self._has_embedding(cand),
            )
        _, prompts, fresh, has_embedding = self._codes_cache
        idx, weights = draw(
            cand,
            want,
            self.config,
            rng,
            self._embeddings,
            prompts=prompts,
            fresh=fresh,
            has_embedding=has_embedding,
        )
        if batch_size is not None and len(idx) < batch_size and not self.config.whole_groups:
            warnings.warn(
                self._short_reason(batch_size, len(idx), cand, prompts),
                ShortBatchWarning,
                stacklevel=3,  # the caller of sample
            )
        cut = None
        if max_tokens is not None:
            keep = fit_budget(row_lengths(cand)[idx], max_tokens)
            assert keep >= 1, "rows longer than max_tokens are not candidates"
            if batch_size is not None:
                cut = len(idx) - keep
                if cut and not self._warned_budget["cut"]:
                    self._warned_budget["cut"] = True
                    warnings.warn(
                        f"step {step}: the token budget max_tokens={max_tokens} held {keep} of "
                        f"the {len(idx)} rows drawn; the rest are not trained this step (each "
                        "train record counts them as batch_shrunk; warned once): raise "
                        "[run].max_tokens_per_batch or lower [run].batch_size",
                        ShrunkBatchWarning,
                        stacklevel=3,
                    )
            idx, weights = idx[:keep], weights[:keep]
        return idx, weights, fresh, cut

    def _short_reason(self, asked: int, got: int, cand: pa.Table, prompts: np.ndarray) -> str:
        cap = self.config.per_prompt_cap
        n_prompts = len(np.unique(prompts))
        head = f"drew {got} of the {asked} rows asked (step {self.step}): "
        if (
            cap is not None
            and n_prompts * cap < min(asked, cand.num_rows)
            or (cap is not None and self.config.replacement)
        ):
            return head + (
                f"per_prompt_cap={cap} allows {cap} rows per prompt and the buffer holds "
                f"{n_prompts} prompts ({cand.num_rows} rows); raise per_prompt_cap or the window"
            )
        return head + (
            f"the buffer holds only {cand.num_rows} eligible rows and replacement=False; "
            "relax window/max_staleness/max_uses/where or set replacement"
        )

    def close(self) -> None:
        """Close this selector's DuckDB connection (it reopens on the next query)."""
        con, self._con = self._con, None
        if con is not None:
            con.close()

    def _has_embedding(self, cand: pa.Table) -> np.ndarray | None:
        """Per candidate: does it carry an embedding (None unless embedding diversity)."""
        if self.config.diversity != "embedding":
            return None
        return ~cand["embedding"].is_null().to_numpy(zero_copy_only=False)

    def _no_embedding(self, cand: pa.Table, idx: np.ndarray) -> int | None:
        """How many drawn rows had no embedding (None unless embedding diversity); warns
        once per selector when any had none."""
        has = self._codes_cache[3] if self._codes_cache is not None else None
        if has is None:
            return None
        n = int((~has[idx]).sum())
        if n and not self._warned_no_embedding:
            self._warned_no_embedding = True
            warnings.warn(
                f"diversity='embedding': {n} of the {len(idx)} rows drawn (and "
                f"{int((~has).sum())} of the {len(has)} eligible rows) have no embedding "
                "(imported rows carry none), so they were drawn with prompt diversity instead; "
                "Selection.no_embedding (the train record's no_embedding) counts them each step",
                MissingEmbeddingWarning,
                stacklevel=3,
            )
        return n

    def _embeddings(self, cand: pa.Table, idx: np.ndarray) -> np.ndarray:
        emb = cand["embedding"].take(pa.array(idx, pa.int64()))
        dim = self.store.embedding_dim
        out = np.zeros((len(idx), dim), np.float32)
        valid = ~emb.is_null().to_numpy(zero_copy_only=False)
        if valid.any():
            flat = emb.filter(pa.array(valid)).combine_chunks().values.to_numpy()
            out[valid] = flat.reshape(-1, dim)
        return out
