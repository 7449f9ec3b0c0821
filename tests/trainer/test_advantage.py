"""Tests for trainer.algo.advantage.group_advantages.

Run: .venv/bin/python -m pytest -q tests/trainer/test_advantage.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trainer.algo.advantage import group_advantages


def test_grpo_hand_computed() -> None:
    # Group a: [1, 0, 0, 1] -> mean 0.5, population std 0.5 -> +-1.
    # Group b: [2, 4, 9]    -> mean 5, std sqrt((9 + 1 + 16) / 3).
    rewards = np.array([1, 0, 0, 1, 2, 4, 9], dtype=np.float64)
    groups = ["a", "a", "a", "a", "b", "b", "b"]
    std_b = np.sqrt(26 / 3)
    expected = [1, -1, -1, 1, -3 / std_b, -1 / std_b, 4 / std_b]
    adv = group_advantages(rewards, groups, eps=0.0)
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_sample_std_option_matches_torch_std() -> None:
    # ddof=1 is verl's / TRL's torch.std (unbiased); a one-row group still gets exactly 0.
    import torch

    rewards = np.array([1, 0, 0, 1, 2, 4, 9, 5], dtype=np.float64)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 2])
    adv = group_advantages(rewards, groups, eps=0.0, ddof=1)
    for g in (0, 1):
        r = torch.tensor(rewards[groups == g])
        np.testing.assert_allclose(adv[groups == g], ((r - r.mean()) / r.std()).numpy(), rtol=1e-6)
    assert adv[7] == 0.0
    # The default is still the population std: {0, 1} -> -1/+1 rather than -0.71/+0.71.
    np.testing.assert_allclose(group_advantages([0.0, 1.0], [0, 0], eps=0.0), [-1, 1])
    np.testing.assert_allclose(
        group_advantages([0.0, 1.0], [0, 0], eps=0.0, ddof=1), [-(0.5**0.5), 0.5**0.5], rtol=1e-6
    )
    with pytest.raises(ValueError, match="ddof"):
        group_advantages([0.0, 1.0], [0, 0], ddof=2)


def test_drgrpo_is_mean_centred_only() -> None:
    adv = group_advantages([1, 0, 0, 1, 2, 4, 9], [0, 0, 0, 0, 1, 1, 1], mode="drgrpo")
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, -3, -1, 4])


def test_eps_enters_the_denominator() -> None:
    adv = group_advantages([0.0, 1.0], [0, 0], eps=0.5)
    np.testing.assert_allclose(adv, [-0.5, 0.5])  # (r - 0.5) / (0.5 + 0.5)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -3.7, 1e9])
def test_constant_groups_get_exact_zero(mode: str, value: float) -> None:
    adv = group_advantages([value] * 7 + [0.0, 1.0], [0] * 7 + [1, 1], mode=mode)
    assert np.all(adv[:7] == 0.0)
    assert adv[7] < 0 < adv[8]


def test_interleaved_groups_match_contiguous() -> None:
    rewards = np.array([0.0, 5.0, 1.0, 7.0, 1.0, 6.0])
    groups = np.array([10, 20, 10, 20, 10, 20])
    adv = group_advantages(rewards, groups)
    np.testing.assert_allclose(adv[::2], group_advantages(rewards[::2], [0, 0, 0]))
    np.testing.assert_allclose(adv[1::2], group_advantages(rewards[1::2], [0, 0, 0]))


@settings(max_examples=80, deadline=None)
@given(
    rewards=hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(-100, 100)),
    n_groups=st.integers(1, 6),
    mode=st.sampled_from(["grpo", "drgrpo"]),
    data=st.data(),
)
def test_permutation_equivariance_and_group_stats(rewards, n_groups, mode, data) -> None:
    groups = data.draw(hnp.arrays(np.int64, rewards.shape, elements=st.integers(0, n_groups - 1)))
    perm = data.draw(st.permutations(range(rewards.size)))
    adv = group_advantages(rewards, groups, mode=mode)
    adv_perm = group_advantages(rewards[perm], groups[perm], mode=mode)
    np.testing.assert_allclose(adv_perm, adv[perm], rtol=1e-5, atol=1e-5)
    for g in np.unique(groups):
        sel = groups == g
        # Centred within every group; in grpo mode also (nearly) unit population std.
        assert abs(adv[sel].astype(np.float64).mean()) < 1e-3 * max(1.0, np.abs(adv[sel]).max())
        if mode == "grpo" and np.ptp(rewards[sel]) > 0.1:
            assert adv[sel].std() == pytest.approx(1.0, rel=1e-3)


def test_empty_input() -> None:
    assert group_advantages(np.array([]), np.array([])).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": [1.0, 2.0], "group_ids": [0], "mode": "grpo"}, "does not match"),
        ({"rewards": [[1.0]], "group_ids": [[0]], "mode": "grpo"}, "1-D"),
        ({"rewards": [1.0], "group_ids": [0], "mode": "ppo"}, "unknown advantage mode 'ppo'"),
        ({"rewards": [float("nan")], "group_ids": [0], "mode": "grpo"}, "NaN"),
    ],
)
def test_invalid_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(kwargs["rewards"], kwargs["group_ids"], mode=kwargs["mode"])
