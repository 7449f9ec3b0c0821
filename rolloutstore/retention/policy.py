"""Diversity-preserving retention: which rows an eviction keeps, and what they cover.

Plain FIFO (``evict(keep_last=N)``) keeps the N newest rollouts. When the newest
rows concentrate on a few prompts or embedding regions (a curriculum moved on, a
sampler favours easy prompts), FIFO drops whole regions of the buffer, and with
them the rare correct answers to hard prompts. :func:`plan_retention` keeps the
``(1 - reserve) * N`` newest rows and spends the reserved ``reserve * N`` rows on
older representatives of the regions those newest rows do not cover; whatever
is left of the reserve goes to the next-newest rows (oldest-first eviction).

Coverage, measured against the store before eviction, over three kinds of unit:

    prompts   distinct ``prompt_id``
    clusters  k-means clusters of the L2-normalised embeddings (seeded; rows with a
              null or all-zero embedding belong to none)
    correct   prompts with at least one correct rollout (``reward > correct_threshold``)

A kind's coverage is the fraction of its units with at least one kept row; the
combined figure is the mean over the kinds the store has (a store without
embeddings or without correct answers is judged on the other kinds). The reserve
is spent greedily on the rows that raise the combined figure most, newest first
among equals, so the plan is a deterministic function of (store version, keep,
config). Only scalar columns and the embedding are read, never token columns.

    from rolloutstore import RolloutStore
    from rolloutstore.retention.policy import RetentionConfig, format_report
    store = RolloutStore.open("runs/demo/store")
    r = store.evict(keep_last=10_000, preserve_diversity=RetentionConfig(reserve=0.2))
    print(format_report(r.coverage))   # or: rolloutstore evict STORE --keep N --preserve-diversity
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.options import help_field as _h

COLUMNS = ["rollout_id", "prompt_id", "policy_version", "created_at", "reward", "embedding"]
NEWEST_FIRST = [
    ("policy_version", "descending"),
    ("created_at", "descending"),
    ("rollout_id", "descending"),
]
KINDS = ("prompts", "clusters", "correct")


@dataclass(frozen=True)
class RetentionConfig:
    """How a diversity-preserving eviction spends its budget (``keep`` is given per call)."""

    reserve: float = _h(
        "share of the kept rows spent on representatives of regions the newest rows miss", 0.2
    )
    clusters: int = _h("k of the k-means clustering of embeddings (coverage unit)", 32)
    correct_threshold: float = _h("reward above which a rollout counts as correct", 0.0)
    fit_rows: int = _h("rows sampled to fit the k-means centres (all rows are assigned)", 50_000)
    kmeans_iters: int = _h("Lloyd iterations of the k-means fit", 20)
    seed: int = _h("seed of the k-means sample and initialisation", 0)

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve <= 1.0:
            raise ValueError(f"RetentionConfig.reserve must be in [0, 1], got {self.reserve!r}")
        for name in ("clusters", "fit_rows", "kmeans_iters"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RetentionConfig.{name} must be a positive int, got {v!r}")
        if not np.isfinite(self.correct_threshold):
            raise ValueError(
                f"RetentionConfig.correct_threshold must be finite, got {self.correct_threshold!r}"
            )


@dataclass(frozen=True)
class Coverage:
    """Units of each kind with at least one kept row, out of the store's units before eviction."""

    rows: int
    covered: dict[str, int]
    total: dict[str, int]

    def fraction(self, kind: str) -> float | None:
        t = self.total[kind]
        return self.covered[kind] / t if t else None

    @property
    def combined(self) -> float:
        """Mean coverage over the kinds the store has (1.0 for an empty store)."""
        fr = [f for f in (self.fraction(k) for k in KINDS) if f is not None]
        return float(np.mean(fr)) if fr else 1.0


@dataclass(frozen=True)
class RetentionReport:
    """What a diversity-preserving eviction kept, and what plain FIFO would have kept."""

    keep: int
    newest: int  # rows kept because they are the newest
    representatives: int  # rows kept to cover regions the newest rows miss
    before: Coverage
    kept: Coverage
    fifo: Coverage


@dataclass(frozen=True)
class RetentionPlan:
    kept: np.ndarray  # (N,) bool over ``table`` rows
    delete: pc.Expression | None  # Lance delete filter; None when nothing goes
    report: RetentionReport


# -- units -------------------------------------------------------------------------------


def _codes(col: pa.ChunkedArray) -> np.ndarray:
    enc = col.combine_chunks().dictionary_encode()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _embeddings(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) float32 unit vectors and a mask of rows that have a non-zero embedding."""
    arr = col.combine_chunks()
    n, d = len(arr), arr.type.list_size
    valid = ~arr.is_null().to_numpy(zero_copy_only=False)
    if valid.all():
        x = arr.flatten().to_numpy(zero_copy_only=False).reshape(n, d).astype(np.float32)
    else:
        x = np.zeros((n, d), np.float32)
        if valid.any():
            flat = arr.filter(pa.array(valid)).flatten().to_numpy(zero_copy_only=False)
            x[valid] = flat.reshape(-1, d)
    norm = np.sqrt(np.einsum("ij,ij->i", x, x))
    valid &= norm > 1e-12
    x /= np.where(valid, norm, 1.0)[:, None]
    return x, valid


def _assign(x: np.ndarray, centres: np.ndarray, chunk: int = 65_536) -> np.ndarray:
    out = np.empty(len(x), np.int64)
    c = centres.astype(np.float32)
    c2 = (c * c).sum(1)
    for s in range(0, len(x), chunk):
        out[s : s + chunk] = np.argmin(c2 - 2.0 * (x[s : s + chunk] @ c.T), axis=1)
    return out


def kmeans_codes(x: np.ndarray, k: int, *, seed: int, fit_rows: int, iters: int) -> np.ndarray:
    """Cluster index per row of ``x`` (N, D) float32: seeded k-means++ and Lloyd on a sample."""
    rng = np.random.default_rng(seed)
    n = len(x)
    fit = x if n <= fit_rows else x[np.sort(rng.choice(n, fit_rows, replace=False))]
    centres = [fit[int(rng.integers(len(fit)))]]
    d2 = ((fit - centres[0]) ** 2).sum(1, dtype=np.float64)
    while len(centres) < k and d2.sum() > 1e-12:  # fewer distinct points than k: stop early
        nxt = fit[int(rng.choice(len(fit), p=d2 / d2.sum()))]
        centres.append(nxt)
        d2 = np.minimum(d2, ((fit - nxt) ** 2).sum(1, dtype=np.float64))
    c = np.stack(centres).astype(np.float64)
    cols = np.ascontiguousarray(fit.T, dtype=np.float64)  # (D, n): one bincount per dimension
    prev = None
    for _ in range(iters):
        a = _assign(fit, c)
        if prev is not None and np.array_equal(a, prev):
            break
        prev = a
        counts = np.bincount(a, minlength=len(c))
        sums = np.stack([np.bincount(a, weights=col, minlength=len(c)) for col in cols], 1)
        nonempty = counts > 0  # an empty cluster keeps its centre
        c[nonempty] = sums[nonempty] / counts[nonempty, None]
    return _assign(x, c)


@dataclass(frozen=True)
class _Units:
    ids: np.ndarray  # (N, 3) global unit id per kind, -1 for none
    weight: np.ndarray  # (U,) contribution of each unit to the combined coverage
    total: dict[str, int]


def _units(table: pa.Table, cfg: RetentionConfig) -> _Units:
    n = table.num_rows
    prompt = _codes(table["prompt_id"])
    n_prompts = int(prompt.max()) + 1 if n else 0

    x, has_emb = _embeddings(table["embedding"])
    cluster = np.full(n, -1, np.int64)
    if has_emb.any():
        k = min(cfg.clusters, int(has_emb.sum()))
        cluster[has_emb] = kmeans_codes(
            x[has_emb], k, seed=cfg.seed, fit_rows=cfg.fit_rows, iters=cfg.kmeans_iters
        )
    # Count clusters that actually hold rows (k-means may leave one empty).
    used = np.unique(cluster[cluster >= 0])
    remap = np.full(cfg.clusters, -1, np.int64)
    remap[used] = np.arange(len(used))
    cluster = np.where(cluster >= 0, remap[cluster.clip(0)], -1)

    reward = table["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
    correct = np.nan_to_num(reward, nan=-np.inf) > cfg.correct_threshold
    good_prompts = np.unique(prompt[correct])
    cmap = np.full(max(n_prompts, 1), -1, np.int64)
    cmap[good_prompts] = np.arange(len(good_prompts))
    correct_unit = np.where(correct, cmap[prompt], -1) if n else prompt

    total = {"prompts": n_prompts, "clusters": len(used), "correct": len(good_prompts)}
    kinds = sum(1 for t in total.values() if t)
    offs = np.cumsum([0, n_prompts, len(used)])
    ids = np.stack(
        [
            prompt,
            np.where(cluster >= 0, cluster + offs[1], -1),
            np.where(correct_unit >= 0, correct_unit + offs[2], -1),
        ],
        axis=1,
    )
    weight = np.concatenate([np.full(t, 1.0 / max(t * kinds, 1)) for t in total.values()]).astype(
        np.float64
    )
    return _Units(ids, weight, total)


def coverage_of(units: _Units, kept: np.ndarray) -> Coverage:
    covered = {}
    for j, kind in enumerate(KINDS):
        u = units.ids[kept, j]
        covered[kind] = len(np.unique(u[u >= 0]))
    return Coverage(int(kept.sum()), covered, dict(units.total))


# -- the policy --------------------------------------------------------------------------


def _representatives(units: _Units, base: np.ndarray, cand: np.ndarray, budget: int) -> np.ndarray:
    """Greedy max coverage: up to ``budget`` of ``cand`` (row indices, newest first)."""
    covered = np.zeros(len(units.weight), bool)
    b = units.ids[base].ravel()
    covered[b[b >= 0]] = True
    ids = units.ids[cand]
    picked = []
    while budget > 0 and len(cand):
        open_ = (ids >= 0) & ~covered[ids.clip(0)]
        gain = (open_ * units.weight[ids.clip(0)]).sum(1)
        live = gain > 0
        cand, ids, open_, gain = cand[live], ids[live], open_[live], gain[live]
        if not len(cand):
            break
        top = np.flatnonzero(gain >= gain.max() * (1 - 1e-9))
        # Accept, in one pass, the top rows that are the newest claimer of every unit they
        # open: they are disjoint, so each still adds the maximal gain. The newest top row
        # always qualifies, so every pass makes progress.
        ok = np.ones(len(top), bool)
        for j in range(ids.shape[1]):
            u = np.where(open_[top, j], ids[top, j], -1)
            first = np.zeros(len(top), bool)
            first[np.unique(u, return_index=True)[1]] = True
            ok &= ~open_[top, j] | first
        acc = top[ok][:budget]
        picked.append(cand[acc])
        got = ids[acc][open_[acc]]
        covered[got] = True
        budget -= len(acc)
        rest = np.ones(len(cand), bool)
        rest[acc] = False
        cand, ids = cand[rest], ids[rest]
    return np.concatenate(picked) if picked else np.zeros(0, np.int64)


def read_rows(ds) -> pa.Table:
    """The columns retention needs, newest first (never the token columns)."""
    t = ds.to_table(columns=COLUMNS)
    return t.take(pc.sort_indices(t, sort_keys=NEWEST_FIRST))


def plan_retention(
    table: pa.Table,
    keep: int,
    config: RetentionConfig | None = None,
    *,
    dropped: np.ndarray | None = None,
) -> RetentionPlan:
    """Which rows of ``table`` (newest first, as :func:`read_rows`) to keep: ``keep`` of them.

    ``dropped``: rows another rule deletes anyway (never kept, not counted in ``keep``).
    """
    cfg = config or RetentionConfig()
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise ValueError(f"keep must be an int >= 0, got {keep!r}")
    n = table.num_rows
    dropped = np.zeros(n, bool) if dropped is None else np.asarray(dropped, bool)
    units = _units(table, cfg)
    eligible = np.flatnonzero(~dropped)  # newest first
    k = min(keep, len(eligible))
    fifo = np.zeros(n, bool)
    fifo[eligible[:k]] = True
    n_newest = k - int(round(cfg.reserve * k))
    kept = np.zeros(n, bool)
    kept[eligible[:n_newest]] = True
    reps = _representatives(units, eligible[:n_newest], eligible[n_newest:], k - n_newest)
    kept[reps] = True
    # Whatever the reserve did not need goes to the next-newest rows.
    fill = eligible[n_newest:][~kept[eligible[n_newest:]]][: k - int(kept.sum())]
    kept[fill] = True
    assert kept.sum() == k
    report = RetentionReport(
        keep=keep,
        newest=n_newest,
        representatives=len(reps),
        before=coverage_of(units, np.ones(n, bool)),
        kept=coverage_of(units, kept),
        fifo=coverage_of(units, fifo),
    )
    # eligible[:n_newest] is a prefix of the table only when no other rule drops a newer row;
    # the filter needs a position prefix, so it cuts at the first row it must not keep.
    return RetentionPlan(kept, _delete_filter(table, kept, _kept_prefix(kept)), report)


def _delete_filter(table: pa.Table, kept: np.ndarray, n_newest: int) -> pc.Expression | None:
    """A Lance filter deleting every row of ``table`` not in ``kept``.

    Rows are matched by position, as plain FIFO does: rows older than the last of the
    ``n_newest`` rows (or, with none, at most as new as the newest row read), except the
    kept ones, which are listed by id. Rows appended after ``table`` was read are newer,
    so they are never deleted, even when Lance retries the commit on a newer version.
    """
    if kept.all():
        return None
    f = pc.field
    last = max(n_newest - 1, 0)
    pv = table["policy_version"][last].as_py()
    ts = table["created_at"][last]
    rid = table["rollout_id"][last].as_py()
    tie = f("rollout_id") < rid if n_newest else f("rollout_id") <= rid
    expr = (f("policy_version") < pv) | (
        (f("policy_version") == pv) & ((f("created_at") < ts) | ((f("created_at") == ts) & tie))
    )
    old_kept = np.flatnonzero(kept)
    old_kept = old_kept[old_kept >= n_newest]
    if len(old_kept):
        expr = expr & ~f("rollout_id").isin(table["rollout_id"].take(pa.array(old_kept)))
    return expr


def _kept_prefix(kept: np.ndarray) -> int:
    lost = np.flatnonzero(~kept)
    return int(lost[0]) if len(lost) else len(kept)


def rule_mask(
    table: pa.Table, *, before: datetime | None, min_policy_version: int | None
) -> np.ndarray:
    """Rows the explicit age / policy-version rules of ``evict`` delete anyway."""
    mask = np.zeros(table.num_rows, bool)
    if min_policy_version is not None:
        mask |= table["policy_version"].to_numpy() < int(min_policy_version)
    if before is not None:
        ts = pa.scalar(before, table.schema.field("created_at").type)
        mask |= pc.less(table["created_at"], ts).to_numpy(zero_copy_only=False)
    return mask


# -- reporting ---------------------------------------------------------------------------


def _fmt(c: Coverage, kind: str) -> str:
    f = c.fraction(kind)
    return "-" if f is None else f"{c.covered[kind]}/{c.total[kind]} ({100 * f:.1f}%)"


def format_report(r: RetentionReport) -> str:
    """A small table: coverage before, after (this policy) and what FIFO would have kept."""
    rows = [("", "rows", *KINDS, "combined")]
    for name, c in (("before", r.before), ("kept", r.kept), ("fifo would keep", r.fifo)):
        rows.append((name, str(c.rows), *(_fmt(c, k) for k in KINDS), f"{c.combined:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    ratio = r.kept.combined / r.fifo.combined if r.fifo.combined else float("inf")
    lines.append(
        f"policy: {r.newest} newest + {r.representatives} representatives of uncovered regions; "
        f"combined coverage {ratio:.2f}x FIFO's"
    )
    return "\n".join(lines)
