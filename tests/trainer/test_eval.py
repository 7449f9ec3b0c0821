"""The [eval] section (issue #33 item 6): standard errors, pass@k, greedy evals, validation."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainer.cli import _apply_sets
from trainer.config import TrainConfig, defaults_toml
from trainer.errors import ConfigError
from trainer.models.tiny import make_tiny_model
from trainer.rollout.evaluation import (
    SAMPLE_SEED,
    EvalConfig,
    evaluate,
    greedy_completions,
    mean_and_se,
    pass_at_k,
    pass_ks,
)
from trainer.rollout.hf import HFGenerator
from trainer.rollout.sampling import GenerationConfig
from trainer.run.resume import effective_config
from trainer.tasks import get_task, score_completion
from trainer.tasks.chat import encode_prompt, render_prompts

# -- statistics -------------------------------------------------------------------------------


def test_standard_error_on_known_inputs():
    mean, se = mean_and_se(np.array([[1.0], [0.0], [1.0], [0.0]]))
    assert mean == 0.5 and se == pytest.approx(math.sqrt(1 / 3) / 2)  # std(ddof=1) / sqrt(4)
    # Samples of one prompt are not independent draws: the SE is over the per-prompt means
    # [1, 0, 0.5] (3 prompts), not over the 6 samples.
    mean, se = mean_and_se(np.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    assert mean == 0.5 and se == pytest.approx(0.5 / math.sqrt(3))
    assert mean_and_se(np.array([[1.0, 0.0]])) == (0.5, pytest.approx(math.nan, nan_ok=True))
    with pytest.raises(ValueError, match="shape"):
        mean_and_se(np.zeros((0, 4)))


def test_pass_at_k_on_known_inputs():
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - math.comb(6, 4) / math.comb(8, 4))
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 5, 4) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_ks(1) == [1] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_is_the_chance_that_k_drawn_of_n_hold_a_correct_one(nc):
    n, c = nc
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"samples_per_prompt": 0}, r"\[eval\]\.samples_per_prompt must be an int >= 1, got 0"),
        ({"prompts": -1}, r"\[eval\]\.prompts must be an int >= 0"),
        ({"every": 1.5}, r"\[eval\]\.every must be an int"),
        ({"temperature": 0}, r"\[eval\]\.temperature must be a number > 0.*greedy = true"),
        ({"greedy": True, "samples_per_prompt": 4}, r"set samples_per_prompt = 1 \(got 4\)"),
        ({"greedy": True, "temperature": 0.5}, r"no effect with greedy = true"),
        ({"greedy": "yes"}, r"\[eval\]\.greedy must be true or false"),
        ({"pass_k": 4}, r"\[eval\]\.pass_k: unknown key"),
    ],
)
def test_eval_config_refusals_name_the_key(values, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict({"eval": values})


def test_greedy_eval_of_a_task_with_tools_is_refused():
    with pytest.raises(ConfigError, match=r"\[eval\]\.greedy with \[task\]\.tools"):
        TrainConfig.from_dict(
            {
                "task": {"tools": ["calculator"]},
                "generation": {"max_turns": 2},
                "eval": {"greedy": True},
            }
        )


def test_eval_keys_from_set_and_in_the_defaults():
    cfg = TrainConfig.from_dict(
        _apply_sets({}, ["eval.samples_per_prompt=8", "eval.temperature=0.6", "eval.every=5"])
    )
    assert cfg.eval == EvalConfig(every=5, samples_per_prompt=8, temperature=0.6)
    text = defaults_toml()
    assert "[eval]" in text and "samples_per_prompt = 1" in text and "greedy = false" in text
    assert cfg.to_dict()["eval"]["samples_per_prompt"] == 8


def test_old_eval_keys_are_read_at_their_new_place_with_a_warning():
    with pytest.warns(FutureWarning, match=r"\[task\]\.eval_prompts moved to \[eval\]\.prompts"):
        cfg = TrainConfig.from_dict({"task": {"eval_prompts": 7}, "run": {"eval_every": 3}})
    assert (cfg.eval.prompts, cfg.eval.every) == (7, 3)
    assert "eval_prompts" not in cfg.to_dict()["task"]
    with pytest.raises(ConfigError, match=r"\[run\]\.eval_every = 3 and \[eval\]\.every = 4"):
        TrainConfig.from_dict({"run": {"eval_every": 3}, "eval": {"every": 4}})
    # A run.json of an earlier run holds the old keys: a resume reads them, silently.
    old = TrainConfig().to_dict()
    old.pop("eval")
    old["task"]["eval_prompts"], old["run"]["eval_every"] = 9, 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = TrainConfig.from_dict(effective_config({"config": old}))
    assert (cfg.eval.prompts, cfg.eval.every) == (9, 2)


# -- evaluation through the transformers backend -------------------------------------------------

TASK = get_task("arith", max_operands=2, max_digits=1, ops=["+"])
GEN = GenerationConfig(backend="hf", max_tokens=5, temperature=1.0)


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> HFGenerator:
    """A tiny model a few supervised steps into the task (some answers right, some wrong)."""
    from trainer.run.setup import warm_start

    folder = tmp_path_factory.mktemp("eval") / "tiny"
    path = make_tiny_model(folder, task="arith", seed=0, num_layers=1)
    g = HFGenerator(Path(path))
    warm_start(g.model.train(), g.tokenizer, TASK, steps=30, lr=5e-3, seed=0)
    g.model.eval()
    return g


def test_greedy_eval_is_the_argmax_continuation_and_repeats(gen):
    made = TASK.make_eval_prompts(6, seed=1)
    texts = [p.prompt_text for p in render_prompts(gen.tokenizer, made, TASK.chat_template)]
    first = greedy_completions(gen, texts, max_tokens=5)
    assert greedy_completions(gen, texts, max_tokens=5) == first
    # Teacher-forced: every generated token is the model's argmax after the tokens before it.
    for text, completion in zip(texts, first):
        prompt = encode_prompt(gen.tokenizer, text)
        done = gen.tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + done])
        with torch.no_grad():
            argmax = gen.model(input_ids=ids).logits[0].argmax(-1).tolist()
        assert done == argmax[len(prompt) - 1 : len(prompt) - 1 + len(done)], completion
    cfg = EvalConfig(prompts=16, greedy=True)
    a, b = evaluate(gen, TASK, cfg, GEN, seed=0), evaluate(gen, TASK, cfg, GEN, seed=0)
    assert (a.reward, a.reward_se, a.pass_at) == (b.reward, b.reward_se, {})
    assert a.record()["greedy"] is True and a.line().endswith("(16 prompts greedy)")


def test_sampled_eval_reports_mean_se_and_pass_at_k_of_its_samples(gen):
    cfg = EvalConfig(prompts=24, samples_per_prompt=4, temperature=0.8)
    res = evaluate(gen, TASK, cfg, GEN, seed=3)
    # The same samples, drawn and scored here: the eval's statistics are theirs.
    made = TASK.make_eval_prompts(24, seed=10_000_019 + 3)
    prompts = render_prompts(gen.tokenizer, made, TASK.chat_template)
    samples = gen.generate_samples(
        [p.prompt_text for p in prompts], group_size=4, temperature=0.8, max_tokens=5,
        seed=3 + SAMPLE_SEED,
    )  # fmt: skip
    rewards = np.array(
        [score_completion(TASK, prompts[s.prompt_index], s.completion_text).reward for s in samples]
    ).reshape(24, 4)
    assert 0 < rewards.mean() < 1, "the fixture's model should be right sometimes"
    assert (res.reward, res.reward_se) == pytest.approx(mean_and_se(rewards))
    counts = rewards.sum(axis=1).astype(int)
    assert sorted(res.pass_at) == [1, 2, 4]
    for k, v in res.pass_at.items():
        assert v == pytest.approx(np.mean([pass_at_k(4, int(c), k) for c in counts]))
    assert res.pass_at[1] == pytest.approx(res.reward)  # 0/1 rewards
    rec = res.record()
    assert rec["pass@4"] == res.pass_at[4] and rec["reward_se"] == res.reward_se
    assert rec["samples_per_prompt"] == 4 and rec["seconds"] > 0
