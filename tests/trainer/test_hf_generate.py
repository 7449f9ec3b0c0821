"""Tests for trainer.rollout.hf: rollout dicts, seeding, and behaviour log-prob consistency.

The tiny Qwen2 model is built once per module into a temporary directory (nothing downloads).
Run: .venv/bin/python -m pytest -q tests/trainer/test_hf_generate.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trainer.models.tiny import make_tiny_model
from trainer.models.tokenizer import tokenizer_fingerprint
from trainer.rollout.hf import (
    HFGenerator,
    max_logprob_gap,
    process_logits,
    teacher_forced_logprobs,
)

PROMPTS = ["Compute 1+2. Answer:", "Compute 37+45*2. Answer:"]
SCHEMA_KEYS = {
    "prompt_ids",
    "completion_ids",
    "behavior_logprobs",
    "prompt_text",
    "completion_text",
    "finish_reason",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "logprobs_mode",
    "generator",
    "policy_version",
    "policy_id",
    "tokenizer_fingerprint",
    "group_id",
    "sample_index",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hfgen") / "tiny", task="arith", seed=0)


@pytest.fixture(scope="module")
def gen(tiny: Path) -> HFGenerator:
    return HFGenerator(tiny, policy_version=7, policy_id="run-a")


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 0), (0.8, 0.9, 40)],
)
def test_behavior_logprobs_match_teacher_forcing(gen, temperature, top_p, top_k) -> None:
    rollouts = gen.generate(
        PROMPTS,
        group_size=3,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=24,
        seed=11,
    )
    assert max_logprob_gap(gen.model, rollouts) < 1e-4


def test_logprobs_are_of_the_processed_distribution(gen) -> None:
    rollouts = gen.generate(PROMPTS, group_size=2, temperature=0.7, max_tokens=16, seed=2)
    r = rollouts[0]
    with torch.no_grad():
        raw = teacher_forced_logprobs(gen.model, r["prompt_ids"], r["completion_ids"], 1.0)
    # Raw (temperature 1) log-probs are measurably different, so the check above is sensitive.
    assert (raw - torch.tensor(r["behavior_logprobs"])).abs().max().item() > 0.05

    greedy_like = gen.generate(PROMPTS, group_size=3, top_k=1, max_tokens=8, seed=5)
    for i in range(0, 6, 3):
        group = greedy_like[i : i + 3]
        assert all(g["completion_ids"] == group[0]["completion_ids"] for g in group)
    # top_k=1 leaves a point mass: every sampled token has processed log-prob 0.
    assert all(lp == 0.0 for g in greedy_like for lp in g["behavior_logprobs"])


def test_rollout_dicts_follow_schema(gen, tiny) -> None:
    rollouts = gen.generate(
        PROMPTS, group_size=4, temperature=0.9, top_p=0.95, max_tokens=12, seed=3
    )
    assert len(rollouts) == 8
    assert all(set(r) == SCHEMA_KEYS for r in rollouts)
    fingerprint = tokenizer_fingerprint(tiny)
    for i, r in enumerate(rollouts):
        prompt = PROMPTS[i // 4]
        assert r["prompt_text"] == prompt
        assert r["prompt_ids"] == gen.tokenizer(prompt)["input_ids"]
        assert r["sample_index"] == i % 4
        assert 1 <= len(r["completion_ids"]) == len(r["behavior_logprobs"]) <= 12
        assert all(lp <= 0.0 for lp in r["behavior_logprobs"])
        assert r["completion_text"] == gen.tokenizer.decode(
            r["completion_ids"], skip_special_tokens=True
        )
        if r["finish_reason"] == "length":
            assert len(r["completion_ids"]) == 12
        else:
            assert r["finish_reason"] == "stop"
        assert (r["temperature"], r["top_p"], r["top_k"], r["max_tokens"], r["seed"]) == (
            0.9,
            0.95,
            0,
            12,
            3,
        )
        assert r["logprobs_mode"] == "processed_logprobs"
        assert r["generator"].startswith("transformers/")
        assert (r["policy_version"], r["policy_id"]) == (7, "run-a")
        assert r["tokenizer_fingerprint"] == fingerprint
    group_ids = [r["group_id"] for r in rollouts]
    assert len(set(group_ids[:4])) == len(set(group_ids[4:])) == 1
    assert group_ids[0] != group_ids[4]
    # Fresh group ids on every call, even with the same seed.
    again = gen.generate(PROMPTS, group_size=4, temperature=0.9, top_p=0.95, max_tokens=12, seed=3)
    assert again[0]["group_id"] not in group_ids


def test_seed_controls_samples_and_leaves_global_rng_alone(gen) -> None:
    torch.manual_seed(99)
    expected_next = torch.rand(2)
    torch.manual_seed(99)
    a = gen.generate(PROMPTS, group_size=2, max_tokens=10, seed=4)
    assert torch.equal(torch.rand(2), expected_next)
    b = gen.generate(PROMPTS, group_size=2, max_tokens=10, seed=4)
    c = gen.generate(PROMPTS, group_size=2, max_tokens=10, seed=5)
    tokens = lambda rs: [r["completion_ids"] for r in rs]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert [r["behavior_logprobs"] for r in a] == [r["behavior_logprobs"] for r in b]
    assert tokens(a) != tokens(c)
    # Samples within a group differ (it is sampling, not one sequence copied).
    assert a[0]["completion_ids"] != a[1]["completion_ids"]


def test_eos_truncates_and_marks_stop(tiny) -> None:
    gen = HFGenerator(tiny, max_batch_size=5)
    eos = gen.tokenizer.eos_token_id
    old = gen.model.lm_head
    # Bias the random model towards EOS so rows finish at different steps within one batch.
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[eos] = 4.0
    gen.model.lm_head = head
    rollouts = gen.generate(PROMPTS, group_size=8, max_tokens=16, seed=0)
    reasons = {r["finish_reason"] for r in rollouts}
    assert reasons == {"stop", "length"}
    for r in rollouts:
        ids = r["completion_ids"]
        if r["finish_reason"] == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == 16 and eos not in ids
        assert "<|endoftext|>" not in r["completion_text"]
    assert len({len(r["completion_ids"]) for r in rollouts}) > 2
    assert max_logprob_gap(gen.model, rollouts) < 1e-4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "greedy"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"group_size": 0}, "group_size"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_sampling_arguments(gen, kwargs: dict, match: str) -> None:
    args = {"group_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        gen.generate(PROMPTS, **args)


def test_prompts_must_be_a_list_and_empty_is_fine(gen) -> None:
    with pytest.raises(ValueError, match="list of str"):
        gen.generate("Compute 1+1. Answer:", group_size=2)  # type: ignore[arg-type]
    assert gen.generate([], group_size=2) == []


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.7), (0.8, 20, 0.9), (1.0, 3, 0.5)],
)
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p) -> None:
    gen_rng = torch.Generator().manual_seed(0)
    # Rounding creates ties, which top-k must keep exactly like transformers does.
    logits = (torch.randn(6, 50, generator=gen_rng) * 3).round(decimals=1)
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    expected = warpers(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    got = process_logits(logits, temperature, top_p, top_k)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite])
    if top_k or top_p < 1.0:
        assert torch.isinf(got).any()
