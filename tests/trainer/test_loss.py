"""Tests pinning the math of trainer.algo.loss: gradients, clipping, IS weights, aggregation."""

from __future__ import annotations

import dataclasses
import math

import hypothesis.extra.numpy as hnp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algo.loss import AGGS, LossConfig, policy_loss

RATIO_LOSSES = ("ppo", "tis", "icepop", "decoupled", "gspo", "m2po")
DT = torch.float64
NORM_LEN = 9  # seq-mean-token-sum-norm's constant (other aggregations ignore it)


def make_batch(seed: int = 0, b: int = 4, t: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=DT) * 3).requires_grad_()
    adv = torch.randn(b, t, generator=g, dtype=DT)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return {"logp": logp, "adv": adv, "mask": mask}


def ref_aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Loop-based aggregation, written independently of the module's vectorised one."""
    rows = []
    for i in range(per_token.shape[0]):
        vals = [per_token[i, j] for j in range(per_token.shape[1]) if mask[i, j]]
        rows.append(vals)
    if agg == "token-mean":
        flat = [v for row in rows for v in row]
        return torch.stack(flat).sum() / len(flat)
    if agg == "seq-mean-token-sum":
        return torch.stack([torch.stack(r).sum() for r in rows]).mean()
    if agg == "seq-mean-token-sum-norm":
        return torch.stack([torch.stack(r).sum() for r in rows]).sum() / (len(rows) * NORM_LEN)
    return torch.stack([torch.stack(r).mean() for r in rows]).mean()


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "loss_type, with_prox",
    [(lt, True) for lt in RATIO_LOSSES] + [(lt, False) for lt in RATIO_LOSSES if lt != "decoupled"],
)
def test_ratio_one_gives_reinforce_gradient(loss_type: str, agg: str, with_prox: bool) -> None:
    d = make_batch(seed=1)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    cfg = LossConfig(loss_type=loss_type, agg=agg, agg_norm_len=NORM_LEN)
    prox = logp.detach().clone() if with_prox else None
    out = policy_loss(logp, logp.detach().clone(), adv, mask, cfg, prox_logp=prox)
    expected = grad_of(ref_aggregate(-adv * logp, mask, agg), logp)
    got = grad_of(out.loss, logp)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert float(out.masked_frac) == 0.0
    assert float(out.clip_frac_low) == 0.0 and float(out.clip_frac_high) == 0.0
    assert float(out.ess_frac) == pytest.approx(1.0)


# (log ratio, advantage, clipped?) for eps_low=0.2, eps_high=0.28
CLIP_CASES = [
    (math.log(1.5), 1.0, True),  # above 1+eps_high, A>0: clip binds
    (math.log(1.5), -1.0, False),  # above, A<0: unclipped branch is the min
    (math.log(0.5), -1.0, True),  # below 1-eps_low, A<0: clip binds
    (math.log(0.5), 1.0, False),
    (math.log(1.25), 1.0, False),  # inside [0.8, 1.28]
    (math.log(0.85), -1.0, False),
]


@pytest.mark.parametrize("loss_type", ["ppo", "tis", "decoupled", "icepop"])
def test_clipping_zeroes_gradient_only_outside_bounds(loss_type: str) -> None:
    log_r = torch.tensor([[c[0] for c in CLIP_CASES]], dtype=DT)
    adv = torch.tensor([[c[1] for c in CLIP_CASES]], dtype=DT)
    clipped = torch.tensor([[c[2] for c in CLIP_CASES]])
    mask = torch.ones_like(clipped)
    logp = torch.full_like(log_r, -1.0).requires_grad_()
    cfg = LossConfig(loss_type=loss_type, eps_low=0.2, eps_high=0.28)
    if loss_type == "ppo":
        behavior, prox = logp.detach() - log_r, None
    else:
        # Trust region is on pi_theta / pi_prox; behaviour within icepop's band (k = 1.1).
        prox = logp.detach() - log_r
        behavior = prox - math.log(1.1)
    out = policy_loss(logp, behavior, adv, mask, cfg, prox_logp=prox)
    g = grad_of(out.loss, logp)
    assert torch.all(g[clipped] == 0)
    assert torch.all(g[~clipped] != 0)
    n = log_r.numel()
    weight = 1.0 if loss_type == "ppo" else 1.1
    expected = -weight * log_r.exp() * adv / n
    torch.testing.assert_close(g[~clipped], expected[~clipped])
    assert float(out.clip_frac_high) == pytest.approx(1 / n)
    assert float(out.clip_frac_low) == pytest.approx(1 / n)


def test_clipping_loss_is_flat_under_finite_differences() -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.28)
    logp = torch.full((1, len(CLIP_CASES)), -1.0, dtype=DT)
    behavior = logp - torch.tensor([[c[0] for c in CLIP_CASES]], dtype=DT)
    adv = torch.tensor([[c[1] for c in CLIP_CASES]], dtype=DT)
    mask = torch.ones_like(logp, dtype=torch.bool)
    base = float(policy_loss(logp, behavior, adv, mask, cfg).loss)
    for j, (_, _, clipped) in enumerate(CLIP_CASES):
        bumped = logp.clone()
        bumped[0, j] += 1e-4
        delta = float(policy_loss(bumped, behavior, adv, mask, cfg).loss) - base
        assert (delta == 0.0) == clipped, (j, delta)


@pytest.mark.parametrize("eps_high, zero", [(0.2, True), (0.28, False)])
def test_eps_high_is_separate_from_eps_low(eps_high: float, zero: bool) -> None:
    logp = torch.tensor([[-1.0]], dtype=DT, requires_grad=True)
    behavior = logp.detach() - math.log(1.25)
    cfg = LossConfig(eps_low=0.2, eps_high=eps_high)
    out = policy_loss(logp, behavior, torch.ones(1, 1, dtype=DT), torch.ones(1, 1), cfg)
    assert (float(grad_of(out.loss, logp)) == 0.0) == zero


log_prob_arrays = hnp.arrays(
    dtype="float64", shape=(3, 5), elements=st.floats(-12.0, 0.0, allow_nan=False)
)


@settings(max_examples=60, deadline=None)
@given(
    lp=log_prob_arrays,
    mu=log_prob_arrays,
    cap=st.floats(1.0, 5.0),
    adv=hnp.arrays(dtype="float64", shape=(3, 5), elements=st.floats(0.1, 3.0)),
)
def test_tis_weight_never_exceeds_cap(lp, mu, cap, adv) -> None:
    logp = torch.tensor(lp, requires_grad=True)
    advt = torch.tensor(adv)
    mask = torch.ones(3, 5, dtype=torch.bool)
    out = policy_loss(logp, torch.tensor(mu), advt, mask, LossConfig(loss_type="tis", tis_cap=cap))
    assert float(out.is_weight_max) <= cap * (1 + 1e-12)
    # The weight actually applied (read back from the gradient, ratio pi/pi_old = 1) obeys it too.
    applied = -grad_of(out.loss, logp) * mask.numel() / advt
    assert torch.all(applied <= cap * (1 + 1e-9))
    expected = torch.clamp(torch.exp(torch.tensor(lp) - torch.tensor(mu)), max=cap)
    torch.testing.assert_close(applied, expected)


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_equals_token_ppo_when_ratios_equal_within_sequence(agg: str) -> None:
    d = make_batch(seed=2)
    logp, mask = d["logp"], d["mask"]
    # One ratio per row, some inside the clip range and some clipped on either side.
    row_log_r = torch.tensor([0.0, 0.5, -0.5, 0.1], dtype=DT)[:, None]
    behavior = torch.where(mask, logp.detach() - row_log_r, torch.full_like(logp, -50.0))
    adv = torch.tensor([1.0, 1.0, -1.0, -0.5], dtype=DT)
    gspo = policy_loss(
        logp, behavior, adv, mask, LossConfig(loss_type="gspo", agg=agg, agg_norm_len=NORM_LEN)
    )
    ppo = policy_loss(
        logp, behavior, adv, mask, LossConfig(loss_type="ppo", agg=agg, agg_norm_len=NORM_LEN)
    )
    torch.testing.assert_close(gspo.loss, ppo.loss)
    torch.testing.assert_close(grad_of(gspo.loss, logp), grad_of(ppo.loss, logp))
    assert float(gspo.clip_frac_high) > 0 and float(gspo.clip_frac_low) > 0


def test_gspo_clips_on_the_sequence_ratio_not_token_ratios() -> None:
    # Token log ratios +0.6 and -0.6 average to 0: the sequence is on-policy, so no clipping
    # even though each token alone would be far outside the trust region.
    logp = torch.tensor([[-1.0, -2.0]], dtype=DT, requires_grad=True)
    behavior = logp.detach() - torch.tensor([[0.6, -0.6]], dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, behavior, torch.ones(1, dtype=DT), mask, LossConfig(loss_type="gspo"))
    torch.testing.assert_close(grad_of(out.loss, logp), torch.full((1, 2), -0.5, dtype=DT))
    assert float(out.clip_frac_high) == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_decoupled_equals_ppo_when_prox_is_behavior(agg: str) -> None:
    d = make_batch(seed=3)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    g = torch.Generator().manual_seed(7)
    behavior = logp.detach() + 0.4 * torch.randn(logp.shape, generator=g, dtype=DT)
    ppo = policy_loss(
        logp, behavior, adv, mask, LossConfig(loss_type="ppo", agg=agg, agg_norm_len=NORM_LEN)
    )
    dec = policy_loss(
        logp,
        behavior,
        adv,
        mask,
        LossConfig(loss_type="decoupled", agg=agg, agg_norm_len=NORM_LEN, decoupled_cap=3.0),
        prox_logp=behavior.clone(),
    )
    torch.testing.assert_close(dec.loss, ppo.loss)
    torch.testing.assert_close(grad_of(dec.loss, logp), grad_of(ppo.loss, logp))
    assert float(ppo.clip_frac_low) + float(ppo.clip_frac_high) > 0  # the clip was exercised


@pytest.mark.parametrize(
    "cap, grad, masked", [(2.0, [0.0, -0.75], 0.5), (None, [-2.5, -0.75], 0.0)]
)
def test_decoupled_weight_is_capped_by_masking(cap, grad, masked) -> None:
    # k = pi_prox / mu = 5 and 1.5: beyond the cap the token is dropped (AReaL), not truncated.
    logp = torch.tensor([[-1.0, -1.0]], dtype=DT, requires_grad=True)
    prox = logp.detach().clone()
    behavior = prox - torch.tensor([[math.log(5.0), math.log(1.5)]], dtype=DT)
    cfg = LossConfig(loss_type="decoupled", decoupled_cap=cap)
    out = policy_loss(
        logp, behavior, torch.ones(1, 2, dtype=DT), torch.ones(1, 2), cfg, prox_logp=prox
    )
    torch.testing.assert_close(grad_of(out.loss, logp), torch.tensor([grad], dtype=DT))
    assert float(out.masked_frac) == masked
    assert float(out.is_weight_max) == pytest.approx(1.5 if cap else 5.0)


@pytest.mark.parametrize("loss_type", ["ppo", "decoupled", "tis"])
def test_dual_clip_bounds_a_negative_advantage_token(loss_type: str) -> None:
    """A token with A < 0 at r = 100 contributes at most c times its on-policy gradient."""
    c = 3.0

    def grad_at(ratio: float, clip_ratio_c: float | None) -> tuple[float, object]:
        logp = torch.tensor([[-1.0, -1.0]], dtype=DT, requires_grad=True)
        log_r = torch.tensor([[math.log(ratio), 0.0]], dtype=DT)
        # ppo: r = pi / mu; tis / decoupled: k = 1 (pi_old = mu) and r_old = pi / pi_old.
        prox = logp.detach() - log_r if loss_type != "ppo" else None
        cfg = LossConfig(loss_type=loss_type, clip_ratio_c=clip_ratio_c, decoupled_cap=None)
        adv = torch.tensor([[-1.0, 1.0]], dtype=DT)
        out = policy_loss(logp, logp.detach() - log_r, adv, torch.ones(1, 2), cfg, prox_logp=prox)
        return float(grad_of(out.loss, logp)[0, 0]), out

    on_policy, _ = grad_at(1.0, c)
    assert on_policy == pytest.approx(0.5)  # -A * r / n_tokens
    for ratio in (3.5, 100.0):
        g, out = grad_at(ratio, c)
        assert abs(g) <= c * abs(on_policy)
        assert g == 0.0 and float(out.clip_frac_dual) == 0.5
        # The reported weight is the one applied: 0 for the clipped token, 1 for the other.
        assert float(out.is_weight_mean) == pytest.approx(0.5) and float(out.ess_frac) == 0.5
        # Without the dual clip the token's gradient is the full ratio times the on-policy one.
        g_off, out_off = grad_at(ratio, None)
        assert g_off == pytest.approx(ratio * on_policy)
        assert float(out_off.clip_frac_dual) == 0.0
    g, _ = grad_at(2.5, c)  # below c the dual clip does not bind
    assert g == pytest.approx(2.5 * on_policy)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_icepop_renorm_removes_masked_tokens_from_the_denominator(agg: str) -> None:
    # k per token: 1, 1.5, 10 (outside [0.5, 2]) in sequence 0; 1, 1 in sequence 1.
    logp = torch.full((2, 3), -1.0, dtype=DT, requires_grad=True)
    k = torch.tensor([[1.0, 1.5, 10.0], [1.0, 1.0, 1.0]], dtype=DT)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.ones(2, 3, dtype=DT)

    def grads(renorm: bool) -> torch.Tensor:
        cfg = LossConfig(loss_type="icepop", agg=agg, icepop_renorm=renorm)
        prox = logp.detach()
        return grad_of(policy_loss(logp, prox - k.log(), adv, mask, cfg, prox_logp=prox).loss, logp)

    kept_k = torch.tensor([[1.0, 1.5, 0.0], [1.0, 1.0, 0.0]], dtype=DT)
    if agg == "token-mean":  # 5 valid tokens, 4 kept
        plain, renormed = -kept_k / 5, -kept_k / 4
    else:  # per sequence: 3 valid / 2 kept, and 2 / 2; mean over 2 sequences
        plain = -kept_k / torch.tensor([[3.0], [2.0]], dtype=DT) / 2
        renormed = -kept_k / torch.tensor([[2.0], [2.0]], dtype=DT) / 2
    torch.testing.assert_close(grads(False), plain)
    torch.testing.assert_close(grads(True), renormed)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss_type", ["ppo", "tis", "icepop", "decoupled", "gspo", "asymre"])
def test_gradient_accumulation_matches_full_batch(loss_type: str, agg: str) -> None:
    d = make_batch(seed=4, b=8, t=6)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    g = torch.Generator().manual_seed(11)
    behavior = logp.detach() + 0.3 * torch.randn(logp.shape, generator=g, dtype=DT)
    prox = logp.detach() + 0.1 * torch.randn(logp.shape, generator=g, dtype=DT)
    cfg = LossConfig(loss_type=loss_type, agg=agg, agg_norm_len=NORM_LEN)
    full = policy_loss(logp, behavior, adv, mask, cfg, prox_logp=prox)
    n_tok, n_seq = int(mask.sum()), mask.shape[0]
    total = torch.zeros((), dtype=DT)
    for rows in torch.arange(8).split(2):
        micro = policy_loss(
            logp[rows],
            behavior[rows],
            adv[rows],
            mask[rows],
            cfg,
            prox_logp=prox[rows],
            num_tokens_global=n_tok,
            num_seqs_global=n_seq,
        )
        total = total + micro.loss
    torch.testing.assert_close(total, full.loss)
    torch.testing.assert_close(grad_of(total, logp), grad_of(full.loss, logp))


def test_icepop_masks_tokens_outside_band() -> None:
    k = torch.tensor([[0.3, 0.6, 1.0, 1.9, 2.5]], dtype=DT)
    logp = torch.full_like(k, -2.0).requires_grad_()
    prox = logp.detach().clone()
    behavior = prox - k.log()
    adv = torch.ones_like(k)
    cfg = LossConfig(loss_type="icepop", icepop_low=0.5, icepop_high=2.0)
    out = policy_loss(logp, behavior, adv, torch.ones_like(k), cfg, prox_logp=prox)
    kept = torch.tensor([[False, True, True, True, False]])
    expected = torch.where(kept, -k / k.numel(), torch.zeros_like(k))
    torch.testing.assert_close(grad_of(out.loss, logp), expected)
    assert float(out.masked_frac) == pytest.approx(2 / 5)


@settings(max_examples=50, deadline=None)
@given(
    log_r=hnp.arrays(dtype="float64", shape=(2, 6), elements=st.floats(-1.0, 1.0)),
    tau=st.floats(0.005, 0.3),
)
def test_m2po_greedy_second_moment_mask(log_r, tau) -> None:
    lr = torch.tensor(log_r)
    logp = torch.full_like(lr, -1.5).requires_grad_()
    adv = torch.ones_like(lr)
    mask = torch.ones_like(lr, dtype=torch.bool)
    out = policy_loss(
        logp, logp.detach() - lr, adv, mask, LossConfig(loss_type="m2po", m2po_tau=tau)
    )
    g = grad_of(out.loss, logp)
    kept = g != 0
    sq = lr**2
    if kept.any():
        assert float(sq[kept].mean()) <= tau + 1e-12
        # Unclipped IS surrogate on the kept tokens.
        torch.testing.assert_close(g[kept], -lr.exp()[kept] / lr.numel())
    if (~kept).any():
        # Greedy: every dropped token is at least as large as every kept one ...
        if kept.any():
            assert float(sq[~kept].min()) >= float(sq[kept].max())
        # ... and dropping one fewer (putting back the smallest dropped) would break the bound.
        back = sq[kept].sum() + sq[~kept].min()
        assert float(back / (int(kept.sum()) + 1)) > tau
    assert float(out.masked_frac) == pytest.approx(float((~kept).float().mean()))


def test_asymre_shifts_the_baseline_down_for_negative_delta() -> None:
    d = make_batch(seed=5)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    behavior = logp.detach() - 0.7  # off-policy: asymre must ignore the ratio
    cfg = LossConfig(loss_type="asymre", asymre_delta=-0.1)
    out = policy_loss(logp, behavior, adv, mask, cfg)
    expected = grad_of(ref_aggregate(-(adv + 0.1) * logp, mask, "token-mean"), logp)
    torch.testing.assert_close(grad_of(out.loss, logp), expected)
    # With zero advantages, a lowered baseline still pushes every sampled token up.
    out0 = policy_loss(logp, behavior, torch.zeros_like(adv), mask, cfg)
    assert torch.all(grad_of(out0.loss, logp)[mask] < 0)


def test_kl_and_entropy_terms() -> None:
    d = make_batch(seed=6)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    behavior = logp.detach().clone()
    ref = logp.detach() + 0.3
    ent = torch.rand(logp.shape, dtype=DT, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    plain = policy_loss(logp, behavior, adv, mask, LossConfig())
    out = policy_loss(logp, behavior, adv, mask, cfg, ref_logp=ref, entropy=ent)
    n = int(mask.sum())
    g_lp, g_ent = torch.autograd.grad(out.loss, [logp, ent])
    kl_grad = torch.where(mask, 0.1 * (1 - torch.exp(ref - logp.detach())) / n, 0.0)
    torch.testing.assert_close(g_lp, grad_of(plain.loss, logp) + kl_grad)
    torch.testing.assert_close(g_ent, torch.where(mask, -0.01 / n, 0.0).to(DT))
    k3 = math.exp(0.3) - 0.3 - 1
    assert float(out.kl_ref) == pytest.approx(k3)
    assert float(out.entropy) == pytest.approx(float(ent.detach()[mask].mean()))


def test_staleness_decay_equals_seq_weights() -> None:
    d = make_batch(seed=7, b=3)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    behavior = logp.detach() - 0.1
    staleness = torch.tensor([0, 1, 2])
    decayed = policy_loss(
        logp, behavior, adv, mask, LossConfig(staleness_decay=0.5), staleness=staleness
    )
    weighted = policy_loss(
        logp, behavior, adv, mask, LossConfig(), seq_weights=torch.tensor([1.0, 0.5, 0.25])
    )
    unweighted = policy_loss(logp, behavior, adv, mask, LossConfig())
    torch.testing.assert_close(decayed.loss, weighted.loss)
    torch.testing.assert_close(grad_of(decayed.loss, logp), grad_of(weighted.loss, logp))
    assert not torch.allclose(decayed.loss, unweighted.loss)
    assert float(decayed.mean_staleness) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "loss_type", ["ppo", "tis", "icepop", "decoupled", "gspo", "asymre", "m2po"]
)
def test_padding_garbage_does_not_leak(loss_type: str) -> None:
    d = make_batch(seed=8)
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    behavior = logp.detach() - 0.05
    prox = logp.detach() - 0.02
    ref = logp.detach() + 0.1
    cfg = LossConfig(loss_type=loss_type, kl_coef=0.05)
    clean = policy_loss(logp, behavior, adv, mask, cfg, prox_logp=prox, ref_logp=ref)

    def dirty(x: torch.Tensor, v: float) -> torch.Tensor:
        return torch.where(mask, x, torch.full_like(x, v))

    logp2 = dirty(logp.detach(), -math.inf).requires_grad_()
    out = policy_loss(
        logp2,
        dirty(behavior, -math.inf),
        dirty(adv, math.nan),
        mask,
        cfg,
        prox_logp=dirty(prox, math.nan),
        ref_logp=dirty(ref, math.inf),
    )
    g = grad_of(out.loss, logp2)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)
    torch.testing.assert_close(out.loss, clean.loss)
    torch.testing.assert_close(g, grad_of(clean.loss, logp))
    assert all(math.isfinite(v) for v in out.metrics().values())


@pytest.mark.parametrize("shape", ["B", "B1"])
def test_sequence_advantages_broadcast(shape: str) -> None:
    d = make_batch(seed=9)
    logp, mask = d["logp"], d["mask"]
    behavior = logp.detach() + 0.2
    seq_adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=DT)
    given_adv = seq_adv if shape == "B" else seq_adv[:, None]
    a = policy_loss(logp, behavior, given_adv, mask, LossConfig())
    b = policy_loss(logp, behavior, seq_adv[:, None].expand(logp.shape), mask, LossConfig())
    torch.testing.assert_close(a.loss, b.loss)


def test_ppo_value_and_diagnostics() -> None:
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=DT, requires_grad=True)
    r = torch.tensor([[0.5, 1.0, 1.1, 2.0]], dtype=DT)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]], dtype=DT)
    out = policy_loss(logp, logp.detach() - r.log(), adv, torch.ones(1, 4), LossConfig())
    surr = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    assert float(out.loss.detach()) == pytest.approx(float(surr.mean()))
    assert float(out.pg_loss) == pytest.approx(float(surr.mean()))
    # The weight the gradient gets: r where the clip does not bind, 0 at r = 2.0 (A > 0).
    w = torch.tensor([[0.5, 1.0, 1.1, 0.0]], dtype=DT)
    assert float(out.is_weight_mean) == pytest.approx(float(w.mean()))
    assert float(out.is_weight_max) == pytest.approx(1.1)
    assert float(out.ess_frac) == pytest.approx(float(w.sum() ** 2 / (4 * (w**2).sum())))
    assert float(out.ratio_max_dev) == pytest.approx(1.0)
    k3 = (r - 1 - r.log()).mean()
    assert float(out.approx_kl) == pytest.approx(float(k3))
    m = out.metrics()
    assert set(m) == {
        "loss",
        "pg_loss",
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac_dual",
        "is_weight_mean",
        "is_weight_max",
        "ess_frac",
        "masked_frac",
        "ratio_max_dev",
        "approx_kl",
    }
    assert all(isinstance(v, float) for v in m.values())
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == 0.0
    assert not out.is_weight_mean.requires_grad


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "reinforce++"}, "reinforce\\+\\+"),
        ({"agg": "token-sum"}, "token-sum"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_high": -0.01}, "eps_high"),
        ({"eps_high": math.nan}, "eps_high"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"icepop_low": 1.5}, "icepop_low"),
        ({"icepop_high": 0.9}, "icepop_high"),
        ({"decoupled_cap": 0.0}, "decoupled_cap"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"agg_norm_len": 0}, "agg_norm_len"),
        ({"m2po_tau": 0.0}, "m2po_tau"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"staleness_decay": 0.0}, "staleness_decay"),
        ({"staleness_decay": 1.5}, "staleness_decay"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_policy_loss_argument_errors() -> None:
    d = make_batch()
    logp, adv, mask = d["logp"], d["adv"], d["mask"]
    mu = logp.detach()
    with pytest.raises(ValueError, match="prox_logp"):
        policy_loss(logp, mu, adv, mask, LossConfig(loss_type="decoupled"))
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, mu, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, mu, adv, mask, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="staleness"):
        policy_loss(logp, mu, adv, mask, LossConfig(staleness_decay=0.9))
    with pytest.raises(ValueError, match="agg_norm_len"):
        policy_loss(logp, mu, adv, mask, LossConfig(agg="seq-mean-token-sum-norm"))
    with pytest.raises(ValueError, match="behavior_logp"):
        policy_loss(logp, mu[:, :-1], adv, mask, LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, mu, adv[:, :-1], mask, LossConfig())
    with pytest.raises(ValueError, match="seq_weights"):
        policy_loss(logp, mu, adv, mask, LossConfig(), seq_weights=torch.ones(3))
    # A config mutated past its validation is still rejected by the loss itself.
    for field, bad in (("loss_type", "nope"), ("agg", "nope")):
        cfg = LossConfig()
        object.__setattr__(cfg, field, bad)
        with pytest.raises(ValueError, match="nope"):
            policy_loss(logp, mu, adv, mask, cfg)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossConfig().eps_low = 0.1  # type: ignore[misc]
