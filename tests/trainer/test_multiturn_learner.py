"""Multi-turn trajectories: tool / environment tokens (loss_mask 0) carry no gradient.

Rows are schema-v2 trajectories stored in a real store (assistant turn, tool turn, assistant
turn, a trailing user turn), drawn by the real loader, trained by the real learner:

(a) the gradient of the loss with respect to the logits that score a mask-0 token is exactly
    zero, and a learner step is bit-for-bit the same when the mask-0 tokens' behaviour
    log-probs and advantages are garbage, or when the trailing mask-0 tokens' ids change
    (an interior environment token is context for the model's later tokens, so its id
    rightly changes their log-probs; the trailing ones are context for nothing trained);
(b) every loss diagnostic (approx KL, entropy, clip fractions, IS-weight / ratio stats, the
    token count) is computed over mask-1 tokens only, for ppo and the other losses.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from trainer.algo.learner import Learner
from trainer.algo.logprobs import sequence_logprobs
from trainer.algo.loss import LOSS_TYPES, LossConfig, policy_loss
from trainer.algo.optim import OptimConfig

VOCAB = 97
N_ROWS = 8
# Losses checked step by step: every one in the registry.
CHECKED = list(LOSS_TYPES)


def _model() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=96,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def base_model() -> Qwen2ForCausalLM:
    return _model()


def _segments(rng) -> list[tuple[str, int]]:
    return [("assistant", int(rng.integers(2, 6))), ("tool", int(rng.integers(2, 5))),
            ("assistant", int(rng.integers(2, 6))), ("user", int(rng.integers(2, 4)))]  # fmt: skip


def _rows(model, *, trailing_offset: int = 0) -> list[dict]:
    """N_ROWS trajectories; behaviour log-probs of mask-1 tokens = the model's own minus
    noise (ratios away from 1, so clipping binds), 0.0 on mask-0 tokens. ``trailing_offset``
    shifts the ids of the trailing user turn only."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(N_ROWS):
        prompt = rng.integers(20, VOCAB, size=3).tolist()
        ids, mask, turns = [], [], []
        for role, n in _segments(rng):
            seg = rng.integers(10, 20, size=n)
            if role == "user":
                seg = (seg + trailing_offset) % VOCAB
            turns.append({"role": role, "start": len(ids), "end": len(ids) + n,
                          "tool_name": "calculator" if role == "tool" else None})  # fmt: skip
            ids += seg.tolist()
            mask += [int(role == "assistant")] * n
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor([prompt + ids])).logprobs[0, 2:]
        noise = rng.normal(0.0, 0.4, size=len(ids))
        blp = np.where(np.array(mask) == 1, np.minimum(lp.numpy() + noise, -1e-3), 0.0)
        rows.append(
            {
                "rollout_id": f"r{i}", "group_id": f"g{i // 4}", "sample_index": i % 4,
                "created_at": "2026-01-01T00:00:00+00:00", "policy_version": 0,
                "prompt_ids": prompt, "completion_ids": ids, "behavior_logprobs": blp.tolist(),
                "loss_mask": mask, "turns": turns, "reward": float(i % 2),
                "advantage": float(i % 2) - 0.5, "temperature": 1.0,
                "logprobs_mode": "processed_logprobs", "finish_reason": "stop",
            }
        )  # fmt: skip
    return rows


def _batch(tmp_path, name: str, rows: list[dict], pack: bool = False) -> dict:
    store = RolloutStore.open(tmp_path / name, embedding_dim=4)
    store.append(rows)
    ds = ReplayDataset(store, ReplayConfig(seed=0), batch_size=N_ROWS, learner_version=0,
                       steps=1, record_usage=False, prefetch=0, pack=pack)  # fmt: skip
    (batch,) = list(ds)
    return batch


def _env_targets(batch: dict, rows: list[dict]) -> torch.Tensor:
    """(B, T-1) bool: target positions holding a mask-0 completion token (padded layout)."""
    by_id = {r["rollout_id"]: r for r in rows}
    env = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for b, rid in enumerate(batch["rollout_ids"]):
        r = by_id[rid]
        p = len(r["prompt_ids"])
        for k, m in enumerate(r["loss_mask"]):
            if m == 0:
                env[b, p + k - 1] = True  # column t scores input token t + 1
    return env


@pytest.fixture(scope="module")
def batches(tmp_path_factory, base_model):
    tmp = tmp_path_factory.mktemp("mt")
    rows = _rows(base_model)
    shifted = _rows(base_model, trailing_offset=37)
    return rows, _batch(tmp, "a", rows), _batch(tmp, "b", shifted)


def test_loader_masks_environment_tokens(batches):
    rows, batch, _ = batches
    env = _env_targets(batch, rows)
    assert env.sum() > 0 and (batch["loss_mask"][env] == 0).all()
    model_tokens = sum(sum(r["loss_mask"]) for r in rows)
    assert int(batch["loss_mask"].sum()) == batch["num_loss_tokens"] == model_tokens
    assert batch["num_tokens"] == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    assert (batch["behavior_logprobs"][env] == 0).all()


@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "tis"])
def test_env_token_logits_get_exactly_zero_gradient(batches, base_model, loss_type):
    rows, batch, _ = batches
    model = copy.deepcopy(base_model)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits  # fmt: skip
    logits.retain_grad()
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    out = policy_loss(
        logp, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"] > 0,
        LossConfig(loss_type=loss_type, entropy_coef=0.01), entropy=entropy,
        prox_logp=logp.detach(),
    )  # fmt: skip
    out.loss.backward()
    grad = logits.grad[:, :-1].abs().sum(-1)  # (B, T-1): gradient reaching each target's logits
    env = _env_targets(batch, rows)
    assert torch.count_nonzero(grad[env]) == 0, "a mask-0 token's logits got a gradient"
    assert (grad[batch["loss_mask"] > 0] > 0).float().mean() > 0.9


def _garbage_at_env(batch: dict, env: torch.Tensor) -> dict:
    out = dict(batch)
    blp = batch["behavior_logprobs"].clone()
    adv = batch["advantages"].clone()
    blp[env] = torch.linspace(-50.0, 7.0, int(env.sum()))  # positive, huge: invalid there
    blp[tuple(env.nonzero()[0].tolist())] = float("nan")
    adv[env] = 1e6
    out["behavior_logprobs"], out["advantages"] = blp, adv
    return out


def _step(base_model, batch: dict, loss_type: str):
    learner = Learner(
        copy.deepcopy(base_model), LossConfig(loss_type=loss_type, entropy_coef=0.01),
        OptimConfig(lr=1e-3, grad_clip=None),
    )  # fmt: skip
    metrics = learner.step(batch)
    metrics.pop("seconds")
    params = {k: v.detach().clone() for k, v in learner.model.named_parameters()}
    return metrics, params


@pytest.mark.parametrize("loss_type", CHECKED)
def test_learner_step_ignores_environment_tokens(batches, base_model, loss_type):
    rows, batch, shifted = batches
    env = _env_targets(batch, rows)
    m0, p0 = _step(base_model, batch, loss_type)
    # Garbage behaviour log-probs / advantages on mask-0 tokens: the same step, bit for bit.
    m1, p1 = _step(base_model, _garbage_at_env(batch, env), loss_type)
    # Other ids for the trailing mask-0 turn (read through the store and the loader).
    assert shifted["rollout_ids"] == batch["rollout_ids"]
    assert not torch.equal(shifted["input_ids"], batch["input_ids"])
    m2, p2 = _step(base_model, shifted, loss_type)
    for m, p in ((m1, p1), (m2, p2)):
        assert m == m0
        assert all(torch.equal(p[k], p0[k]) for k in p0)
    assert m0["tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    # Control: the same garbage on tokens the mask lets through does change the step.
    leaky = _garbage_at_env(batch, env)
    leaky["loss_mask"] = batch["loss_mask"] + env.float()
    m3, _ = _step(base_model, leaky, loss_type)
    assert m3 != m0


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_diagnostics_are_over_model_tokens_only(batches, base_model, loss_type):
    """Each diagnostic equals its value computed by hand over the mask-1 tokens."""
    rows, batch, _ = batches
    mask = batch["loss_mask"] > 0
    with torch.no_grad():
        out = sequence_logprobs(
            base_model, batch["input_ids"], attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"], return_entropy=True,
        )  # fmt: skip
    logp, ent = out.logprobs, out.entropy
    log_r = (logp - batch["behavior_logprobs"])[mask].double()
    r = log_r.exp()
    m, _ = _step(base_model, batch, loss_type)
    assert m["tokens"] == int(mask.sum())
    assert m["approx_kl"] == pytest.approx(float((r - 1 - log_r).mean()), rel=1e-4)
    assert m["entropy"] == pytest.approx(float(ent[mask].double().mean()), rel=1e-4)
    if loss_type == "ppo":
        cfg = LossConfig()
        adv = batch["advantages"][mask].double()
        low = ((r < 1 - cfg.eps_low) & (adv < 0)).double().mean()
        high = ((r > 1 + cfg.eps_high) & (adv > 0)).double().mean()
        assert low + high > 0, "the test data should make clipping bind somewhere"
        assert m["clip_frac_low"] == pytest.approx(float(low), abs=1e-6)
        assert m["clip_frac_high"] == pytest.approx(float(high), abs=1e-6)
        assert m["ratio_max_dev"] == pytest.approx(float((r - 1).abs().max()), rel=1e-4)
        flows = ~(((r < 1 - cfg.eps_low) & (adv < 0)) | ((r > 1 + cfg.eps_high) & (adv > 0)))
        w = torch.where(flows, r, torch.zeros_like(r))
        assert m["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
        assert m["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-4)


def test_packed_batch_masks_environment_tokens_too(tmp_path, base_model, batches):
    rows, batch, _ = batches
    packed = _batch(tmp_path, "p", rows, pack=True)
    assert packed["num_loss_tokens"] == batch["num_loss_tokens"]
    m_pad, p_pad = _step(base_model, batch, "ppo")
    m_pack, p_pack = _step(base_model, packed, "ppo")
    assert m_pack["tokens"] == m_pad["tokens"]
    for k in p_pad:
        torch.testing.assert_close(p_pack[k], p_pad[k], atol=1e-6, rtol=1e-4)
