"""Learner: trains on real stored replay batches; micro-batching, packing and resume are exact.

The store holds rows written here with token ids below the tiny model's vocabulary and
behaviour log-probs computed by the model itself, so every ratio is 1 at step 0.
Run: ``python -m pytest -q tests/trainer/test_learner.py``.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from trainer.algo.epochs import mini_batch_plan
from trainer.algo.learner import Learner
from trainer.algo.logprobs import sequence_logprobs
from trainer.algo.loss import LOSS_TYPES, LossConfig
from trainer.algo.optim import OptimConfig

VOCAB = 97
REWARDED = 10  # reward = 1 when the completion contains this token
N_ROWS = 32


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def base_model() -> Qwen2ForCausalLM:
    return _model(0)


@pytest.fixture(scope="module")
def store(tmp_path_factory, base_model) -> RolloutStore:
    rng = np.random.default_rng(0)
    rows = []
    with torch.no_grad():
        for i in range(N_ROWS):
            prompt = rng.integers(20, VOCAB, size=int(rng.integers(2, 7))).tolist()
            # Completions over tokens 10..19 contain the rewarded token about half the time.
            completion = rng.integers(10, 20, size=int(rng.integers(3, 9))).tolist()
            ids = torch.tensor([prompt + completion])
            lp = sequence_logprobs(base_model, ids).logprobs[0, len(prompt) - 1 :]
            rows.append(
                {
                    "run_id": "t",
                    "group_id": f"g{i // 4}",
                    "sample_index": i % 4,
                    "policy_version": 0,
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "behavior_logprobs": lp.tolist(),
                    "reward": float(REWARDED in completion),
                    "temperature": 1.0,
                }
            )
    rewards = np.array([r["reward"] for r in rows]).reshape(-1, 4)
    adv = (rewards - rewards.mean(axis=1, keepdims=True)).reshape(-1)
    for r, a in zip(rows, adv):
        r["advantage"] = float(a)
    assert 0.2 < rewards.mean() < 0.8
    s = RolloutStore.open(tmp_path_factory.mktemp("learner") / "store", embedding_dim=8)
    s.append(rows)
    return s.checkout(s.version)


def _batches(store, n, *, seed=0, batch_size=12, priority="uniform", **kw):
    kw.setdefault("learner_version", 2)
    cfg = ReplayConfig(seed=seed, priority=priority)
    ds = ReplayDataset(
        store, cfg, batch_size=batch_size, steps=n, record_usage=False, prefetch=0, **kw
    )
    return list(ds)


def _learner(base_model, loss="ppo", *, lr=1e-3, learner_kw=None, **optim) -> Learner:
    loss_cfg = loss if isinstance(loss, LossConfig) else LossConfig(loss_type=loss)
    optim.setdefault("grad_clip", None)
    return Learner(
        copy.deepcopy(base_model), loss_cfg, OptimConfig(lr=lr, **optim), **(learner_kw or {})
    )


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.named_parameters()}


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.grad.detach().clone() for k, v in learner.model.named_parameters()}


def _assert_close(a: dict, b: dict, atol: float, rtol: float = 1e-4) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=k)


# -- (a) every loss type trains ------------------------------------------------------------
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_on_stored_batches(store, base_model, loss_type):
    learner = _learner(base_model, loss_type)
    before = _params(learner)
    for i, batch in enumerate(_batches(store, 2)):
        m = learner.step(batch)
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert m["policy_version"] == i + 1 == learner.policy_version
        assert m["sequences"] == 12 and m["tokens"] == int(batch["loss_mask"].sum())
        assert m["staleness"] == 2.0 and m["skipped"] == 0.0
        for key in ("clip_frac_low", "is_weight_mean", "ess_frac", "approx_kl", "pg_loss"):
            assert math.isfinite(m[key]), key
    after = _params(learner)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_ratio_is_one_at_step_zero(store, base_model):
    # Behaviour log-probs came from the same weights: nothing is clipped, KL ~ 0.
    m = _learner(base_model, "ppo").step(_batches(store, 1)[0])
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    assert abs(m["is_weight_mean"] - 1.0) < 1e-5 and m["approx_kl"] < 1e-8


# -- (b) learning signal -------------------------------------------------------------------
def _mean_logp_by_sign(learner: Learner, batch) -> tuple[float, float]:
    lp = learner.sequence_logprobs(batch)
    mask = batch["loss_mask"]
    per_seq = (lp * mask).sum(1) / mask.sum(1)
    adv = batch["seq_advantages"]
    return float(per_seq[adv > 0].mean()), float(per_seq[adv < 0].mean())


def test_ppo_raises_logp_of_positive_completions(store, base_model):
    (everything,) = _batches(store, 1, batch_size=N_ROWS)
    learner = _learner(base_model, "ppo", lr=3e-3, grad_clip=1.0)
    pos0, neg0 = _mean_logp_by_sign(learner, everything)
    for batch in _batches(store, 20, seed=1, batch_size=16):
        learner.step(batch)
    pos1, neg1 = _mean_logp_by_sign(learner, everything)
    assert pos1 - pos0 > 0.1 and (pos1 - pos0) - (neg1 - neg0) > 0.3


# -- (c) micro-batching and packing are exact ----------------------------------------------
CASES = [
    LossConfig(loss_type="ppo"),
    LossConfig(loss_type="gspo", agg="seq-mean-token-mean"),
    LossConfig(loss_type="decoupled", agg="seq-mean-token-sum"),
]


@pytest.mark.parametrize("loss_cfg", CASES, ids=lambda c: c.loss_type)
def test_micro_batches_equal_one_big_batch(store, base_model, loss_cfg):
    kw = dict(batch_size=16, priority="advantage")  # non-uniform IS weights
    (big,) = _batches(store, 1, **kw)
    (from_loader,) = _batches(store, 1, micro_batch_tokens=40, **kw)
    assert isinstance(from_loader, list) and len(from_loader) > 2
    assert sum((mb["rollout_ids"] for mb in from_loader), []) == big["rollout_ids"]
    assert not torch.all(big["weights"] == 1)

    ref = _learner(base_model, loss_cfg)
    ref.step(big)
    for batch, budget in ((from_loader, None), (big, 40)):
        learner = _learner(base_model, loss_cfg, micro_batch_tokens=budget)
        m = learner.step(batch)
        assert m["micro_batches"] > 2
        _assert_close(_grads(learner), _grads(ref), atol=1e-7)
        _assert_close(_params(learner), _params(ref), atol=1e-5)


@pytest.mark.parametrize("loss_cfg", CASES, ids=lambda c: c.loss_type)
@pytest.mark.parametrize("budget", [None, 50])
def test_packed_equals_padded(store, base_model, loss_cfg, budget):
    kw = dict(batch_size=16, priority="advantage")
    (padded,) = _batches(store, 1, **kw)
    (packed,) = _batches(store, 1, pack=True, **kw)
    assert packed["rollout_ids"] == padded["rollout_ids"] and packed["input_ids"].shape[0] == 1
    ref = _learner(base_model, loss_cfg)
    m_ref = ref.step(padded)
    learner = _learner(base_model, loss_cfg, micro_batch_tokens=budget)
    m = learner.step(packed)
    assert m["tokens"] == m_ref["tokens"] and (budget is None) == (m["micro_batches"] == 1)
    assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5, abs=1e-7)
    _assert_close(_grads(learner), _grads(ref), atol=1e-7)
    _assert_close(_params(learner), _params(ref), atol=1e-5)


# -- (d) PPO at ratio 1 is REINFORCE -------------------------------------------------------
def test_ppo_first_update_equals_reinforce_at_ratio_one(store, base_model):
    (batch,) = _batches(store, 1, batch_size=16)
    ppo = _learner(base_model, "ppo")
    reinforce = _learner(base_model, LossConfig(loss_type="asymre", asymre_delta=0.0))
    m_ppo = ppo.step(batch)
    reinforce.step(batch)
    assert m_ppo["loss"] != pytest.approx(0.0)
    _assert_close(_grads(ppo), _grads(reinforce), atol=1e-7)
    _assert_close(_params(ppo), _params(reinforce), atol=1e-6)
    # ...whereas a shifted baseline (delta != 0) gives a different update.
    shifted = _learner(base_model, LossConfig(loss_type="asymre", asymre_delta=-0.5))
    shifted.step(batch)
    assert not torch.allclose(_grads(shifted)["lm_head.weight"], _grads(ppo)["lm_head.weight"])


# -- (e) exact resume ----------------------------------------------------------------------
def test_state_dict_round_trip_resumes_bit_for_bit(store, base_model):
    batches = _batches(store, 6, batch_size=8)
    optim = dict(lr=2e-3, warmup_steps=2, lr_schedule="cosine", total_steps=6, grad_clip=1.0)
    loss = LossConfig(loss_type="ppo")
    straight = Learner(copy.deepcopy(base_model), loss, OptimConfig(**optim))
    lrs = [straight.step(b)["lr"] for b in batches]

    first = Learner(copy.deepcopy(base_model), loss, OptimConfig(**optim))
    for b in batches[:3]:
        first.step(b)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    del first
    buf.seek(0)
    # A differently initialised model: everything must come from the checkpoint.
    resumed = Learner(_model(seed=123), loss, OptimConfig(**optim))
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    assert resumed.policy_version == 3
    resumed_lrs = [resumed.step(b)["lr"] for b in batches[3:]]

    assert resumed_lrs == lrs[3:] and resumed.policy_version == straight.policy_version == 6
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


# -- options -------------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_update(store, base_model):
    (batch,) = _batches(store, 1, batch_size=8)
    plain = _learner(base_model)
    ckpt = _learner(base_model, learner_kw={"gradient_checkpointing": True})
    flag = getattr(type(ckpt.model), "is_activation_checkpointing", None)
    assert ckpt.model.is_activation_checkpointing if flag else ckpt.model.is_gradient_checkpointing
    plain.step(batch), ckpt.step(batch)
    _assert_close(_grads(ckpt), _grads(plain), atol=1e-7)


def test_temperature_changes_logprobs_and_clip_applies(store, base_model):
    (batch,) = _batches(store, 1, batch_size=8)
    # The rows recorded temperature 1 (their log-probs are at 1): the learner's own setting
    # only fills in rows that recorded none, so configuring it at 0.5 changes nothing...
    learner = Learner(
        copy.deepcopy(base_model), LossConfig(), OptimConfig(lr=1e-3), temperature=0.5
    )
    assert learner.step(batch)["approx_kl"] < 1e-8
    # ...while rows that say they were sampled at 0.5 are scored at 0.5: every ratio moves.
    learner = Learner(copy.deepcopy(base_model), LossConfig(), OptimConfig(lr=1e-3))
    m = learner.step({**batch, "temperature": torch.full_like(batch["temperature"], 0.5)})
    assert m["approx_kl"] > 1e-3 and m["clip_frac_low"] + m["clip_frac_high"] > 0


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine", total_steps=14)
    f = [cfg.lr_factor(s) for s in range(16)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[9] == pytest.approx(0.5) and f[14] == f[15] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"lr_schedule": "linear"}, "lr_schedule"),
        ({"lr_schedule": "cosine"}, "total_steps"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
    ],
)
def test_optim_config_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        OptimConfig(**kwargs)


def test_kl_penalty_needs_a_reference_model(base_model):
    with pytest.raises(ValueError, match="ref_model"):
        Learner(copy.deepcopy(base_model), LossConfig(kl_coef=0.1), OptimConfig())


def test_dr_grpo_aggregation_normalises_by_a_constant(store, base_model):
    (batch,) = _batches(store, 1, batch_size=8)
    with pytest.raises(ValueError, match="agg_norm_len"):
        _learner(base_model, LossConfig(agg="seq-mean-token-sum-norm"))
    # Same gradient direction as seq-mean-token-sum, scaled by exactly 1 / agg_norm_len.
    norm = _learner(base_model, LossConfig(agg="seq-mean-token-sum-norm", agg_norm_len=16))
    plain = _learner(base_model, LossConfig(agg="seq-mean-token-sum"))
    norm.step(batch), plain.step(batch)
    g_norm, g_plain = _grads(norm), _grads(plain)
    _assert_close({k: v * 16 for k, v in g_norm.items()}, g_plain, atol=1e-7)


# -- PPO epochs / mini-batches -------------------------------------------------------------
def test_ppo_epochs_clip_around_pi_old(store, base_model):
    (batch,) = _batches(store, 1, batch_size=12)
    loss = LossConfig(loss_type="decoupled", eps_low=0.05, eps_high=0.05)
    learner = _learner(base_model, loss, lr=2e-2, ppo_epochs=2, mini_batches=2)
    m = learner.step(batch)
    ups = learner.update_metrics
    assert len(ups) == 4 and m["optimizer_steps"] == 4.0
    # One drawn batch: the version and the LR schedule advance once.
    assert learner.policy_version == 1 and m["policy_version"] == 1.0
    # First mini-batch: the weights are still pi_old, on exactly the scored tensors.
    assert ups[0]["ratio_max_dev"] == 0.0
    assert ups[0]["clip_frac_low"] == ups[0]["clip_frac_high"] == 0.0
    # Later mini-batches move away from pi_old and the clip binds.
    assert all(u["ratio_max_dev"] > 0 for u in ups[1:])
    assert sum(u["clip_frac_low"] + u["clip_frac_high"] for u in ups[1:]) > 0
    assert m["clip_frac_low"] + m["clip_frac_high"] > 0
    assert m["sequences"] == 12 and m["staleness"] == 2.0


@pytest.mark.parametrize("loss_type", ["decoupled", "ppo"])
def test_ppo_epochs_packed_equals_padded(store, base_model, loss_type):
    kw = dict(batch_size=12, priority="advantage")
    (padded,) = _batches(store, 1, **kw)
    (packed,) = _batches(store, 1, pack=True, **kw)
    a = _learner(base_model, loss_type, ppo_epochs=2, mini_batches=3)
    b = _learner(base_model, loss_type, ppo_epochs=2, mini_batches=3, micro_batch_tokens=50)
    a.step(padded), b.step(packed)
    assert len(a.update_metrics) == len(b.update_metrics) == 6
    for ua, ub in zip(a.update_metrics, b.update_metrics):
        assert ua["loss"] == pytest.approx(ub["loss"], rel=1e-4, abs=1e-6)
    _assert_close(_params(a), _params(b), atol=1e-5)


def test_ppo_epochs_resume_bit_for_bit(store, base_model):
    batches = _batches(store, 4, batch_size=8)
    optim = dict(lr=5e-3, ppo_epochs=2, mini_batches=2, seed=3, warmup_steps=1)
    loss = LossConfig(loss_type="decoupled")
    straight = Learner(copy.deepcopy(base_model), loss, OptimConfig(**optim))
    ms = [straight.step(b) for b in batches]

    first = Learner(copy.deepcopy(base_model), loss, OptimConfig(**optim))
    for b in batches[:2]:
        first.step(b)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Learner(_model(seed=123), loss, OptimConfig(**optim))
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    ms_resumed = [resumed.step(b) for b in batches[2:]]
    assert [m["loss"] for m in ms_resumed] == [m["loss"] for m in ms[2:]]
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The order is a function of the learner step: another step number, another order.
    assert not all(
        np.array_equal(x, y)
        for x, y in zip(
            mini_batch_plan(3, straight.steps_done, 0, 8, 2),
            mini_batch_plan(3, first.steps_done, 0, 8, 2),
        )
    )


# -- per-row behaviour distributions -------------------------------------------------------
@pytest.fixture(scope="module")
def sampled_store(tmp_path_factory):
    """Rows the real HF generator sampled from the tiny model at two non-default settings."""
    from trainer.models.tiny import make_tiny_model
    from trainer.rollout.hf import HFGenerator

    tmp = tmp_path_factory.mktemp("per_row")
    tiny = make_tiny_model(tmp / "tiny", task="arith", seed=0)
    gen = HFGenerator(tiny, policy_version=0, policy_id="r")
    prompts = ["Compute 1+2. Answer:", "Compute 37+45*2. Answer:"]
    rows = gen.generate(prompts, group_size=2, temperature=0.7, max_tokens=12, seed=1)
    rows += gen.generate(prompts, group_size=2, temperature=0.8, top_p=0.9, top_k=40,
                         max_tokens=12, seed=2)  # fmt: skip
    for r in rows:
        r.update(run_id="r", reward=0.0, advantage=0.0)
    s = RolloutStore.open(tmp / "store", embedding_dim=8)
    s.append(rows)
    return s, copy.deepcopy(gen.model).float(), rows


@pytest.mark.parametrize("pack", [False, True])
def test_rows_are_scored_with_their_own_sampling_settings(sampled_store, pack):
    store, model, rows = sampled_store
    (batch,) = _batches(store, 1, batch_size=len(rows), pack=pack, learner_version=0)
    assert sorted(batch["temperature"].tolist()) == pytest.approx([0.7] * 4 + [0.8] * 4)
    assert sorted(batch["top_k"].tolist()) == [0] * 4 + [40] * 4
    # The learner is configured at the run's temperature 1.0, no top-k / top-p.
    learner = Learner(model, LossConfig(), OptimConfig(lr=1e-3))
    mask, blp, _ = learner._targets(batch)
    logp = learner.sequence_logprobs(batch)
    gap = (logp - blp).abs()[mask].max().item()
    assert gap < 1e-5
    # Scored at the configured 1.0 instead, the same tokens are far off: the check is sensitive.
    plain = {k: v for k, v in batch.items() if k not in ("temperature", "top_k", "top_p")}
    assert (learner.sequence_logprobs(plain) - blp).abs()[mask].max().item() > 0.05


def test_rows_with_raw_logprobs_are_refused(sampled_store, tmp_path, base_model):
    from trainer.errors import BehaviorPolicyError, TrainerError
    from trainer.run.sources import import_sources

    store, _, rows = sampled_store
    raw = [{**r, "logprobs_mode": "raw_logprobs", "rollout_id": None} for r in rows[:2]]
    for r in raw:
        r.pop("rollout_id")
    src = RolloutStore.open(tmp_path / "src", embedding_dim=8)
    src.append(raw)
    (batch,) = _batches(src, 1, batch_size=2, learner_version=0)
    learner = _learner(base_model)
    with pytest.raises(BehaviorPolicyError, match="raw_logprobs.*temperature=0.7") as err:
        learner.step(batch)
    assert isinstance(err.value, TrainerError) and learner.policy_version == 0
    # Importing the run as a replay source is refused before anything is copied.
    dest = RolloutStore.open(tmp_path / "dest", embedding_dim=8)
    fp = rows[0]["tokenizer_fingerprint"]
    with pytest.raises(BehaviorPolicyError, match="replay source .*raw_logprobs"):
        import_sources(dest, [str(tmp_path / "src")], run_id="new", fingerprint=fp)
    assert dest.sql("SELECT count(*) AS n FROM rollouts")["n"][0].as_py() == 0
