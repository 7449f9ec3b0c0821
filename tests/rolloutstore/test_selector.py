"""Each selection strategy does what it promises, on a real store."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import EmptyBufferError, ReplayConfig, RolloutStore, Selector
from rolloutstore.io.proxy import proxy_batches


def _fill(store: RolloutStore, versions, per_version: int = 64, group_size: int = 8, dim=None):
    """Append ``per_version`` proxy rollouts for each version in ``versions`` (in that order)."""
    for k, v in enumerate(versions):
        t = next(
            proxy_batches(
                per_version,
                seed=1000 + k,
                group_size=group_size,
                mean_completion_tokens=12,
                prompt_tokens=(2, 6),
                batch_rollouts=per_version,
                run_id=f"r{v % 2}",
                start_index=k * per_version,
                embedding_dim=dim or store.embedding_dim,
            )
        )
        t = t.set_column(
            t.schema.get_field_index("policy_version"),
            "policy_version",
            __import__("pyarrow").array(np.full(t.num_rows, v, np.int64)),
        )
        store.append(t)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    store = RolloutStore.open(tmp_path_factory.mktemp("sel") / "store", embedding_dim=8)
    _fill(store, range(8))
    return store


def _all(store):
    return store.sql(
        "SELECT rollout_id, policy_version, created_at, run_id, prompt_id, group_id, reward, "
        "advantage FROM rollouts ORDER BY policy_version DESC, created_at DESC, rollout_id DESC"
    ).to_pylist()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    order=st.permutations(list(range(6))),
    window=st.one_of(st.none(), st.integers(1, 300)),
    staleness=st.one_of(st.none(), st.integers(0, 6)),
    runs=st.sampled_from([None, ("r0",), ("r1",)]),
    where=st.sampled_from([None, "reward > ?"]),
)
def test_window_matches_brute_force_even_with_late_appends(
    tmp_path_factory, order, window, staleness, runs, where
):
    # Versions appended out of order (a slow actor) must not fool fragment pruning.
    store = RolloutStore.open(tmp_path_factory.mktemp("w") / "s", embedding_dim=8)
    _fill(store, order, per_version=40)
    params = (0.5,) if where else ()
    cfg = ReplayConfig(
        window=window, max_staleness=staleness, runs=runs, where=where, where_params=params
    )
    got = Selector(store, cfg, record_usage=False).candidates(learner_version=6)
    rows = [r for r in _all(store) if runs is None or r["run_id"] in runs]
    rows = [r for r in rows if where is None or r["reward"] > 0.5]
    rows = rows[:window] if window else rows
    if staleness is not None:
        rows = [r for r in rows if r["policy_version"] >= 6 - staleness]
    assert got["rollout_id"].to_pylist() == [r["rollout_id"] for r in rows]


def test_staleness_bound_is_never_violated(filled):
    sel = Selector(
        filled, ReplayConfig(max_staleness=2, replacement=True, seed=1), record_usage=False
    )
    for lv in range(7, 10):
        s = sel.sample(128, learner_version=lv)
        assert s.staleness.max() <= 2 and (s.policy_version >= lv - 2).all()
    with pytest.raises(EmptyBufferError, match="relax"):
        sel.sample(8, learner_version=100)


def test_reuse_cap_is_never_exceeded(tmp_path):
    store = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    _fill(store, range(2), per_version=48)
    sel = Selector(store, ReplayConfig(max_uses=2, seed=0))
    drawn = Counter()
    with pytest.raises(EmptyBufferError):
        for _ in range(100):
            drawn.update(sel.sample(20, learner_version=2).rollout_ids)
    assert max(drawn.values()) == 2 and len(drawn) == 96  # every row used exactly to the cap
    logged = store.sql("SELECT rollout_id, count(*) AS n FROM usage GROUP BY 1").to_pylist()
    assert {r["rollout_id"]: r["n"] for r in logged} == dict(drawn)
    # A fresh selector of the same run resumes the counts from the usage log.
    again = Selector(store, ReplayConfig(max_uses=2, seed=0))
    again.load_state_dict({"step": sel.step})
    with pytest.raises(EmptyBufferError):
        again.sample(1, learner_version=2)


def test_no_duplicates_without_replacement_and_per_prompt_cap(filled):
    s = Selector(filled, ReplayConfig(per_prompt_cap=2, seed=5), record_usage=False).sample(40, 8)
    assert len(set(s.rollout_ids)) == 40
    assert max(Counter(s.prompt_ids).values()) <= 2


def test_whole_groups_and_zero_variance(filled):
    s = Selector(filled, ReplayConfig(whole_groups=True, seed=2), record_usage=False).sample(32, 8)
    groups = filled.sql("SELECT group_id, n, reward_std FROM groups").to_pylist()
    size = {g["group_id"]: g["n"] for g in groups}
    got = filled.sql(
        "SELECT group_id, count(*) AS k FROM rollouts WHERE list_contains(?, rollout_id) GROUP BY 1",
        [s.rollout_ids],
    ).to_pylist()
    assert got and all(g["k"] == size[g["group_id"]] for g in got)
    cfg = ReplayConfig(drop_zero_variance_groups=True, seed=2)
    cand = Selector(filled, cfg, record_usage=False).candidates(8)
    flat = {g["group_id"] for g in groups if g["reward_std"] == 0}
    assert flat and not flat & set(cand["group_id"].to_pylist())


def test_positive_fraction_holds_and_comes_from_the_freshest(filled):
    cfg = ReplayConfig(positive_fraction=0.25, positive_threshold=0.5, positive_pool=64, seed=0)
    sel = Selector(filled, cfg, record_usage=False)
    fresh_pos = {
        r["rollout_id"] for r in _all(filled) if r["reward"] is not None and r["reward"] > 0.5
    }
    fresh_pos = set(
        list(r["rollout_id"] for r in _all(filled) if r["rollout_id"] in fresh_pos)[:64]
    )
    base_rate = np.mean([r["reward"] > 0.5 for r in _all(filled)])
    shares = []
    for _ in range(30):
        s = sel.sample(64, 8)
        assert len(fresh_pos & set(s.rollout_ids[:16])) == 16  # the positive share, from the pool
        shares.append(np.mean([rid in fresh_pos or False for rid in s.rollout_ids]))
    # At least the positive share, plus what uniform sampling adds (within sampling error).
    expected = 0.25 + 0.75 * base_rate * 64 / filled.count()
    assert np.mean(shares) == pytest.approx(expected, abs=0.05)


def test_advantage_priority_prefers_large_advantages_with_weights(filled):
    cfg = ReplayConfig(priority="advantage", alpha=1.0, beta=1.0, replacement=True, seed=3)
    sel = Selector(filled, cfg, record_usage=False)
    adv = {r["rollout_id"]: abs(r["advantage"]) for r in _all(filled)}
    picked = []
    for _ in range(10):
        s = sel.sample(256, 8)
        picked += [adv[r] for r in s.rollout_ids]
        # beta = 1: weight ~ 1 / P, so weight * (|A| + eps) is constant within a batch.
        prod = s.weights * (np.array([adv[r] for r in s.rollout_ids]) + cfg.priority_eps)
        np.testing.assert_allclose(prod, prod[0], rtol=1e-4)
    # Sampling ~ |A| + eps: the mean |A| drawn is E[|A|(|A|+eps)] / E[|A|+eps], above the plain mean.
    a = np.array(list(adv.values()))
    expected = np.sum(a * (a + cfg.priority_eps)) / np.sum(a + cfg.priority_eps)
    assert expected > 1.1 * a.mean()
    assert np.mean(picked) == pytest.approx(expected, rel=0.04)


def test_prompt_diversity_spreads_over_prompts(filled):
    n_prompts = filled.sql("SELECT count(DISTINCT prompt_id) AS n FROM rollouts")["n"][0].as_py()
    s = Selector(filled, ReplayConfig(diversity="prompt", seed=4), record_usage=False).sample(48, 8)
    assert len(set(s.prompt_ids)) == min(48, n_prompts)
    u = Selector(filled, ReplayConfig(seed=4), record_usage=False).sample(48, 8)
    assert len(set(u.prompt_ids)) < len(set(s.prompt_ids))


def test_embedding_diversity_covers_the_space_better_than_uniform(tmp_path):
    store = RolloutStore.open(tmp_path / "s", embedding_dim=2)
    rng = np.random.default_rng(0)
    # Two dense clusters and a few far-away points: uniform sampling misses the outliers.
    pts = np.concatenate(
        [rng.normal(0, 0.01, (300, 2)), rng.normal(1, 0.01, (300, 2)), rng.uniform(-5, 5, (12, 2))]
    ).astype(np.float32)
    rows = make_rows(len(pts))
    for r, p in zip(rows, pts):
        r["embedding"] = p.tolist()
    store.append(rows)

    def cover_radius(ids):
        chosen = np.array([emb[i] for i in ids])
        return max(np.min(np.linalg.norm(chosen - p, axis=1)) for p in pts)

    emb = {
        r["rollout_id"]: np.array(r["embedding"]) for r in store.dataset().to_table().to_pylist()
    }
    div = Selector(
        store, ReplayConfig(diversity="embedding", diversity_pool=100), record_usage=False
    )
    uni = Selector(store, ReplayConfig(), record_usage=False)
    assert cover_radius(div.sample(16, 0).rollout_ids) < 0.5 * cover_radius(
        uni.sample(16, 0).rollout_ids
    )


def test_runs_and_parameterized_where(filled):
    cfg = ReplayConfig(
        runs=("r1",), where="reward > ? AND policy_version < ?", where_params=(0.5, 6)
    )
    cand = Selector(filled, cfg, record_usage=False).candidates(8).to_pylist()
    assert cand and all(
        r["run_id"] == "r1" and r["reward"] > 0.5 and r["policy_version"] < 6 for r in cand
    )
    for bad in ["1=1) OR (1=1", "true; DROP TABLE x", "true -- x", "reward > 0 /* x */"]:
        with pytest.raises(ValueError, match="single filter"):
            ReplayConfig(where=bad)


def test_same_seed_same_selection_and_explain(filled):
    snap = filled.checkout(filled.version)
    cfg = ReplayConfig(window=300, seed=11, priority="advantage")
    a = [Selector(snap, cfg, record_usage=False).sample(32, 8).rollout_ids for _ in range(2)]
    assert a[0] == a[1]
    other = Selector(
        snap, ReplayConfig(window=300, seed=12, priority="advantage"), record_usage=False
    )
    assert other.sample(32, 8).rollout_ids != a[0]
    assert "LIMIT 300" in Selector(snap, cfg).explain()


def test_max_tokens_fills_a_token_budget(filled):
    sel = Selector(filled, ReplayConfig(seed=1), record_usage=False)
    s = sel.sample(None, 8, max_tokens=500)
    t = filled.take_rows(
        s.row_addresses, columns=["rollout_id", "num_prompt_tokens", "num_completion_tokens"]
    )
    assert t["rollout_id"].to_pylist() == s.rollout_ids
    total = sum(
        a + b
        for a, b in zip(t["num_prompt_tokens"].to_pylist(), t["num_completion_tokens"].to_pylist())
    )
    assert total <= 500 and total > 500 - 80


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="window"):
        ReplayConfig(window=0)
    with pytest.raises(ValueError, match="priority"):
        ReplayConfig(priority="loss")
    with pytest.raises(ValueError, match="unknown ReplayConfig keys"):
        ReplayConfig.from_dict({"windw": 3})
    cfg = ReplayConfig(window=5, runs=["a"], where="reward > ?", where_params=[1])
    assert ReplayConfig.from_dict(cfg.to_dict()) == cfg


def test_steps_already_in_the_usage_log_are_not_recorded_again(tmp_path):
    # A resumed run retakes steps its killed predecessor drew: the log keeps each step once,
    # and max_uses still counts each step's use once.
    store = RolloutStore.open(tmp_path / "s")
    store.append(make_rows(32))
    cfg = ReplayConfig(window=32, max_uses=2, seed=3)
    first = Selector(store, cfg, run_id="r")
    drawn = [first.sample(8, learner_version=0).rollout_ids for _ in range(2)]
    again = Selector(store, cfg, run_id="r")
    again.usage_recorded_through = 1  # what the trainer reads from the log on resume
    assert [again.sample(8, learner_version=0).rollout_ids for _ in range(2)] == drawn
    again.sample(8, learner_version=0)
    steps = store.sql("SELECT learner_step, count(*) AS n FROM usage GROUP BY 1 ORDER BY 1")
    assert steps.to_pylist() == [{"learner_step": s, "n": 8} for s in range(3)]
