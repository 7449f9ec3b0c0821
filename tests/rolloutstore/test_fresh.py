"""Fresh/replay mix: a fixed share of each batch from the newest policy version(s)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import make_rows

from rolloutstore import RolloutStore
from rolloutstore.replay import ReplayConfig, Selector

ROWS_PER_VERSION = 64


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.open(tmp_path_factory.mktemp("fresh") / "s")
    for v in range(6):
        s.append(make_rows(ROWS_PER_VERSION, seed=v, policy_version=v))
    return s


def _versions(store) -> dict[str, int]:
    t = store.sql("SELECT rollout_id, policy_version FROM rollouts")
    return dict(zip(t["rollout_id"].to_pylist(), t["policy_version"].to_pylist()))


def _draws(store, cfg, steps, batch, **kw):
    sel = Selector(store, cfg, record_usage=False)
    return [sel.sample(batch, 6, learner_step=s, **kw) for s in range(steps)]


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.8])
def test_fresh_share_holds_and_fresh_rows_are_the_newest_version(store, frac):
    pv = _versions(store)
    batch = 32
    for s in _draws(store, ReplayConfig(fresh_fraction=frac, seed=4), steps=8, batch=batch):
        versions = np.asarray([pv[r] for r in s.rollout_ids])
        assert len(s) == batch and len(set(s.rollout_ids)) == batch
        np.testing.assert_array_equal(s.fresh, versions == 5)
        assert int(s.fresh.sum()) == round(frac * batch)


def test_sides_are_uniform_within_sampling_error(store):
    """fresh_versions=2: fresh = versions {4, 5}; each side draws uniformly over its rows."""
    pv = _versions(store)
    steps, batch, frac = 40, 32, 0.5
    draws = _draws(store, ReplayConfig(fresh_fraction=frac, fresh_versions=2, seed=7), steps, batch)
    fresh_v, old_v = [], []
    for s in draws:
        v = np.asarray([pv[r] for r in s.rollout_ids])
        np.testing.assert_array_equal(s.fresh, v >= 4)
        fresh_v += v[s.fresh].tolist()
        old_v += v[~s.fresh].tolist()
    # Fresh side: versions 4 and 5 equally likely (64 rows each).
    n = len(fresh_v)
    share5 = np.mean(np.asarray(fresh_v) == 5)
    assert abs(share5 - 0.5) <= 4 * math.sqrt(0.25 / n)
    # Replay side: versions 0..3, each 1/4.
    old_v = np.asarray(old_v)
    for v in range(4):
        p = np.mean(old_v == v)
        assert abs(p - 0.25) <= 4 * math.sqrt(0.25 * 0.75 / len(old_v)), (v, p)


def test_deterministic_per_seed_and_step(store):
    cfg = ReplayConfig(fresh_fraction=0.3, priority="advantage", seed=11)
    a = [s.rollout_ids for s in _draws(store, cfg, 3, 24)]
    b = [s.rollout_ids for s in _draws(store, cfg, 3, 24)]
    c = [s.rollout_ids for s in _draws(store, ReplayConfig(fresh_fraction=0.3, seed=12), 3, 24)]
    assert a == b and a != c and a[0] != a[1]


def test_short_side_is_topped_up_from_the_other(tmp_path):
    s = RolloutStore.open(tmp_path / "s")
    s.append(make_rows(40, seed=0, policy_version=0))
    s.append(make_rows(6, seed=1, policy_version=1))
    # Fresh side has 6 rows, asked for 16: the rest comes from the replay side.
    sel = Selector(s, ReplayConfig(fresh_fraction=0.5), record_usage=False).sample(32, 1)
    assert len(sel) == 32 and int(sel.fresh.sum()) == 6
    # Replay side has 40 rows, asked for 45: topped up with fresh rows.
    sel = Selector(s, ReplayConfig(fresh_fraction=0.02), record_usage=False).sample(46, 1)
    assert len(sel) == 46 and int((~sel.fresh).sum()) == 40 and len(set(sel.rollout_ids)) == 46


def test_mix_with_whole_groups_per_prompt_cap_and_positives(store):
    pv = _versions(store)
    groups = store.sql("SELECT rollout_id, group_id FROM rollouts")
    gid = dict(zip(groups["rollout_id"].to_pylist(), groups["group_id"].to_pylist()))
    cfg = ReplayConfig(fresh_fraction=0.3, whole_groups=True, seed=2)
    for s in _draws(store, cfg, 6, 32):
        # Whole groups of 4: the fresh quota round(0.3 * 32) = 10 rows is met group by group.
        counts = {}
        for r in s.rollout_ids:
            counts[gid[r]] = counts.get(gid[r], 0) + 1
        assert set(counts.values()) == {4}
        n_fresh = int(s.fresh.sum())
        assert 10 <= n_fresh < 10 + 4 and len(s) == 32
        np.testing.assert_array_equal(s.fresh, [pv[r] == 5 for r in s.rollout_ids])

    prompts = store.sql("SELECT rollout_id, prompt_id FROM rollouts")
    pid = dict(zip(prompts["rollout_id"].to_pylist(), prompts["prompt_id"].to_pylist()))
    cfg = ReplayConfig(fresh_fraction=0.5, per_prompt_cap=1, positive_fraction=0.5, seed=3)
    for s in _draws(store, cfg, 4, 32):
        assert len({pid[r] for r in s.rollout_ids}) == len(s) == 32
        assert int(s.fresh.sum()) == 16
        # Each side leads with its positives: round(0.5 * 16) = 8 per side.
        assert int(np.sum(s.rewards[s.fresh] > 0)) >= 8
        assert int(np.sum(s.rewards[~s.fresh] > 0)) >= 8


def test_token_budget_prefix_keeps_the_share(store):
    cfg = ReplayConfig(fresh_fraction=0.25, seed=5)
    for s in _draws(store, cfg, 4, None, max_tokens=600):
        # The batch is a prefix of the interleaved draw: the share holds to within a row.
        assert abs(int(s.fresh.sum()) - 0.25 * len(s)) <= 1.0
        assert len(s) > 4


def test_importance_weights_under_a_mix(store):
    uni = _draws(store, ReplayConfig(fresh_fraction=0.5, seed=1), 2, 32)
    assert all(np.all(s.weights == 1.0) for s in uni)

    beta = 0.6
    cfg = ReplayConfig(fresh_fraction=0.5, priority="advantage", beta=beta, seed=1)
    t = store.sql("SELECT rollout_id, policy_version, advantage FROM rollouts")
    ids = t["rollout_id"].to_pylist()
    a = np.abs(np.nan_to_num(np.asarray(t["advantage"].to_pylist(), np.float64))) + 1e-3
    fresh = np.asarray(t["policy_version"].to_pylist()) == 5
    raw = np.zeros(len(ids))
    for side in (fresh, ~fresh):  # w = (N_s P_s)^-beta within each side
        raw[side] = (side.sum() * a[side] / a[side].sum()) ** (-beta)
    expect = dict(zip(ids, raw / raw.max()))
    for s in _draws(store, cfg, 2, 32):
        np.testing.assert_allclose(s.weights, [expect[r] for r in s.rollout_ids], rtol=1e-5)
