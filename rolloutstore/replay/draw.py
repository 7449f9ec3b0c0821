"""The draw: which rows of a candidate table make a batch (pure numpy over Arrow columns).

``draw`` is called by :class:`~rolloutstore.replay.selector.Selector` with the candidate
buffer (after window, staleness, use-cap and group filters) and a generator seeded by
(seed, step); it applies ``fresh_fraction``, ``positive_fraction``, priority, diversity,
``per_prompt_cap``, ``whole_groups`` and ``replacement`` and returns row indices and
importance weights. See the selector's module docstring for the semantics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from rolloutstore.replay.config import ReplayConfig


def _gumbel_order(logp: np.ndarray, rng: np.random.Generator, k: int | None = None) -> np.ndarray:
    """A random order that is sampling without replacement with probabilities ~ exp(logp);
    with ``k``, only its first ``k`` (the same rows, and the generator moves on the same)."""
    neg = -(logp + rng.gumbel(size=len(logp)))
    if k is None or k >= len(neg):
        return np.argsort(neg, kind="stable")
    if k <= 0:
        return np.zeros(0, np.int64)
    kth = np.partition(neg, k - 1)[k - 1]
    if np.isnan(kth):
        return np.argsort(neg, kind="stable")[:k]
    # Every row of the full order's first k, ties at the k-th key included, in index order:
    # a stable sort of them is the full stable sort's prefix.
    top = np.flatnonzero(neg <= kth)
    return top[np.argsort(neg[top], kind="stable")[:k]]


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


def draw(
    cand: pa.Table,
    batch_size: int,
    cfg: ReplayConfig,
    rng,
    embeddings,
    prompts=None,
    fresh: np.ndarray | None = None,
    has_embedding: np.ndarray | None = None,
):
    """(indices into ``cand``, importance weights); ``fresh`` marks the fresh rows of a mix;
    ``has_embedding`` the rows embedding diversity can place (default: all).

    Without ``replacement`` no row is returned twice."""
    n = cand.num_rows
    prompts = codes(cand["prompt_id"]) if prompts is None else prompts
    reward = cand["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
    adv = np.nan_to_num(cand["advantage"].to_numpy(zero_copy_only=False).astype(np.float64))
    mix = fresh is not None and cfg.fresh_fraction > 0
    if cfg.whole_groups:
        return _draw_groups(cand, batch_size, cfg, rng, adv, fresh if mix else None)

    logp = np.zeros(n)
    if cfg.priority == "advantage":
        logp = cfg.alpha * np.log(np.abs(adv) + cfg.priority_eps)
    if has_embedding is None:
        has_embedding = np.ones(n, bool)
    side = _Side(cand, cfg, rng, embeddings, prompts, reward, logp, {}, has_embedding)
    if not mix:
        rows = np.arange(n)
        idx, n_pos = side.draw(rows, batch_size)
        raw = side.weights(rows)
        w = raw[idx] / raw.max() if len(idx) else np.ones(0)
        w[:n_pos] = 1.0
        return idx, w

    fresh_rows, old_rows = np.flatnonzero(fresh), np.flatnonzero(~fresh)
    k_fresh = int(round(cfg.fresh_fraction * batch_size))
    if not len(old_rows):
        k_fresh = batch_size
    if not cfg.replacement:
        k_fresh = min(k_fresh, len(fresh_rows))
    a, a_pos = side.draw(fresh_rows, k_fresh)
    b, b_pos = side.draw(old_rows, batch_size - len(a))
    short = batch_size - len(a) - len(b)
    if short > 0:  # the replay side ran out (or its prompts hit the cap): top up with fresh
        more = fresh_rows if cfg.replacement else np.setdiff1d(fresh_rows, a)
        extra, _ = side.draw(more, short)
        a = np.concatenate([a, extra])
    raw = np.zeros(n)
    raw[fresh_rows] = side.weights(fresh_rows)
    raw[old_rows] = side.weights(old_rows)
    wa, wb = raw[a] / raw.max(), raw[b] / raw.max()
    wa[:a_pos], wb[:b_pos] = 1.0, 1.0
    order = np.argsort(
        np.concatenate(_shares(np.ones(len(a)), np.ones(len(b)), cfg.fresh_fraction)),
        kind="stable",
    )
    return np.concatenate([a, b])[order], np.concatenate([wa, wb])[order]


def _shares(rows_a: np.ndarray, rows_b: np.ndarray, f: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge keys for two lists of items holding ``rows_*`` rows each: sorting by them puts
    a share ``f`` of the rows from ``a`` into every prefix, until one list runs out."""
    mid_a = np.cumsum(rows_a) - rows_a / 2
    mid_b = np.cumsum(rows_b) - rows_b / 2
    with np.errstate(divide="ignore"):
        return mid_a / f if f > 0 else mid_a + np.inf, mid_b / (1 - f) if f < 1 else mid_b + np.inf


class _Side:
    """The draw within one set of candidate rows (the whole buffer, or one side of a mix)."""

    def __init__(self, cand, cfg, rng, embeddings, prompts, reward, logp, taken, has_embedding):
        self.cand, self.cfg, self.rng, self.embeddings = cand, cfg, rng, embeddings
        self.prompts, self.reward, self.logp = prompts, reward, logp
        self.taken = taken  # per-prompt picks, shared by every side of one batch
        self.has_embedding = has_embedding

    def weights(self, rows: np.ndarray) -> np.ndarray:
        """Unnormalised importance weights (N P)^-beta of ``rows`` (1 for uniform priority)."""
        if self.cfg.priority != "advantage" or not len(rows):
            return np.ones(len(rows))
        lp = self.logp[rows]
        probs = np.exp(lp - lp.max())
        probs /= probs.sum()
        return (len(rows) * probs) ** (-self.cfg.beta)

    def draw(self, rows: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """``k`` of ``rows`` (indices into the candidates), and how many lead as positives."""
        cfg, rng = self.cfg, self.rng
        if k <= 0 or not len(rows):
            return np.zeros(0, np.int64), 0
        lp = self.logp[rows]
        prompts = self.prompts[rows]
        probs = np.exp(lp - lp.max())
        probs /= probs.sum()
        cap = cfg.per_prompt_cap
        chosen = np.zeros(0, np.int64)
        k_pos = int(round(cfg.positive_fraction * k))
        if k_pos:
            # Candidates are newest first, so the first positives are the freshest.
            reward = np.nan_to_num(self.reward[rows], nan=-np.inf)
            pool = np.flatnonzero(reward > cfg.positive_threshold)[: cfg.positive_pool]
            if len(pool):
                order = pool[_gumbel_order(np.zeros(len(pool)), rng)]
                if cfg.replacement:
                    order = rng.choice(pool, size=k_pos * 4)
                chosen = _take_in_order(order, k_pos, prompts, cap, self.taken)
        rest = k - len(chosen)
        remaining = np.arange(len(rows))
        if len(chosen) and not cfg.replacement:
            remaining = np.setdiff1d(remaining, chosen)
        if cfg.diversity == "prompt":
            order = _prompt_round_robin(remaining, prompts, lp, rng)
        elif cfg.diversity == "embedding":
            order = self._embedding_order(rows, remaining, lp, prompts, rest)
        elif cfg.replacement:
            p = probs[remaining] / probs[remaining].sum()
            order = rng.choice(remaining, size=rest * 4 + 16, p=p)
        else:
            # Without a per-prompt cap only the first `rest` of the order are taken.
            order = remaining[_gumbel_order(lp[remaining], rng, rest if cap is None else None)]
        rest_idx = _take_in_order(order, rest, prompts, cap, self.taken)
        return rows[np.concatenate([chosen, rest_idx])].astype(np.int64), len(chosen)

    def _embedding_order(self, rows, remaining, lp, prompts, rest) -> np.ndarray:
        """Farthest-point order over a priority-drawn pool; the pool's rows without an
        embedding (imported rows) cannot be placed, so they are drawn with prompt diversity
        instead and interleaved at their share of the pool."""
        cfg, rng = self.cfg, self.rng
        pool_n = min(len(remaining), cfg.diversity_pool * max(rest, 1))
        pool = remaining[_gumbel_order(lp[remaining], rng, pool_n)]
        has = self.has_embedding[rows[pool]]
        placed, unplaced = pool[has], pool[~has]
        order = placed[_farthest_point(self.embeddings(self.cand, rows[placed]), rest, rng)]
        if not len(unplaced):
            return order
        other = _prompt_round_robin(unplaced, prompts, lp, rng)
        ka, kb = _shares(np.ones(len(order)), np.ones(len(other)), len(placed) / len(pool))
        return np.concatenate([order, other])[np.argsort(np.concatenate([ka, kb]), kind="stable")]


def fresh_mask(policy_version: np.ndarray, fresh_versions: int) -> np.ndarray:
    """Rows whose policy_version is among the ``fresh_versions`` highest present."""
    if not len(policy_version):
        return np.zeros(0, bool)
    top = np.unique(policy_version)[-fresh_versions:]
    return np.isin(policy_version, top)


def floats(col: pa.ChunkedArray) -> np.ndarray:
    return col.to_numpy(zero_copy_only=False).astype(np.float32)


def codes(col: pa.ChunkedArray) -> np.ndarray:
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
    # A picked row is never picked again, even when every row left lies at distance 0
    # (identical embeddings): argmax over all-zero distances would return the first row.
    d[first] = -np.inf
    for _ in range(k - 1):
        nxt = int(np.argmax(d))
        picked.append(nxt)
        d = np.minimum(d, np.linalg.norm(x - x[nxt], axis=1))
        d[nxt] = -np.inf
    return np.asarray(picked, np.int64)


def _draw_groups(cand: pa.Table, batch_size: int, cfg: ReplayConfig, rng, adv, fresh=None):
    groups = codes(cand["group_id"])
    uniq, first_idx, inverse = np.unique(groups, return_index=True, return_inverse=True)
    # Keep the candidates' (newest-first) order among groups.
    by_age = np.argsort(first_idx, kind="stable")
    sizes = np.bincount(inverse, minlength=len(uniq))
    logp = np.zeros(len(uniq))
    if cfg.priority == "advantage":
        mean_abs = np.bincount(inverse, weights=np.abs(adv), minlength=len(uniq)) / sizes
        logp = cfg.alpha * np.log(mean_abs + cfg.priority_eps)
    order = by_age[_gumbel_order(logp[by_age], rng)]
    if fresh is None:
        picked = _fill_groups(order, sizes, batch_size, 0)[0]
    else:
        # Quota in rows, filled group by group: fresh groups first up to round(f * B)
        # rows, then replay groups up to B, then more fresh groups if replay ran out.
        g_fresh = np.zeros(len(uniq), bool)
        np.logical_or.at(g_fresh, inverse, fresh)
        is_fresh = g_fresh[order]
        k_fresh = int(round(cfg.fresh_fraction * batch_size))
        a, rows_a = _fill_groups(order[is_fresh], sizes, k_fresh, 0)
        b, rows_b = _fill_groups(order[~is_fresh], sizes, batch_size, rows_a)
        more, _ = _fill_groups(order[is_fresh][len(a) :], sizes, batch_size, rows_a + rows_b)
        a = a + more
        # Interleave by each group's middle row, so every prefix keeps the share.
        ka, kb = _shares(sizes[a].astype(float), sizes[b].astype(float), cfg.fresh_fraction)
        picked = [(a + b)[i] for i in np.argsort(np.concatenate([ka, kb]), kind="stable")]
    if not picked:
        return np.zeros(0, np.int64), np.ones(0)
    idx = np.concatenate([np.flatnonzero(inverse == g) for g in picked]).astype(np.int64)
    return idx, np.ones(len(idx))


def _fill_groups(order, sizes, target: int, have: int) -> tuple[list, int]:
    """Groups from ``order`` until ``have`` + their rows reaches ``target``; (groups, rows)."""
    picked, rows = [], 0
    for g in order:
        if have + rows >= target:
            break
        picked.append(int(g))
        rows += int(sizes[g])
    return picked, rows
