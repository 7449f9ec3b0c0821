"""Long-context limits: prompts beyond the model's context ([generation] prompt_overflow), rows
beyond the learner's micro-batch budget, and a token-budget-shrunk batch in a run's records.

A tiny model with 64 positions; one short and one long prompt through the real generate
pipeline (transformers; one vLLM engine for the same rule with its max_model_len) into a real
store. Run: .venv/bin/python -m pytest -q tests/trainer/test_long_context.py
"""

from __future__ import annotations

import json
import tomllib
import warnings

import numpy as np
import pytest
import torch
from helpers import require_vllm, resumable_run_toml, with_eval
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.errors import ShrunkBatchWarning
from trainer.algo.learner import Learner, MicroBatchBudgetWarning
from trainer.algo.loss import LossConfig
from trainer.algo.optim import OptimConfig
from trainer.config import TrainConfig
from trainer.errors import ConfigError, TaskError
from trainer.models.tiny import make_tiny_model
from trainer.rollout.evaluation import EvalConfig, evaluate
from trainer.rollout.hf import HFGenerator
from trainer.rollout.pipeline import RoundIds, generate_rollouts
from trainer.rollout.sampling import GenerationConfig
from trainer.run.sync import train
from trainer.tasks import Prompt, get_task
from trainer.tasks.arith import ArithTask
from trainer.tasks.chat import (
    PromptOverflowWarning,
    PromptTooLongError,
    _left_cut,
    encode_prompt,
    fit_prompts,
)

POSITIONS, MAX_TOKENS = 64, 8
SHORT = Prompt("Compute 1+2. Answer:", "3")
LONG = Prompt("Compute " + " + ".join(["1"] * 60) + ". Answer:", "60")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("ctx") / "tiny", num_layers=1, num_texts=300,
        max_position_embeddings=POSITIONS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def gen(model_dir):
    return HFGenerator(model_dir)


def _round(store, gen, policy: str, prompts=(SHORT, LONG)):
    g = GenerationConfig(group_size=2, max_tokens=MAX_TOKENS, prompt_overflow=policy)
    return generate_rollouts(
        store, gen, get_task("arith"), list(prompts), generation=g, policy_version=0,
        ids=RoundIds(run_id="ctx"), progress=False,
    )  # fmt: skip


def test_the_long_prompt_really_overflows(gen):
    assert gen.max_model_len == POSITIONS
    assert len(encode_prompt(gen.tokenizer, LONG.prompt_text)) + MAX_TOKENS > POSITIONS
    assert len(encode_prompt(gen.tokenizer, SHORT.prompt_text)) + MAX_TOKENS <= POSITIONS


def test_error_refuses_the_round_naming_prompt_length_limit_and_fix(store, gen):
    n = len(encode_prompt(gen.tokenizer, LONG.prompt_text))
    with pytest.raises(PromptTooLongError) as info:
        _round(store, gen, "error")
    msg = str(info.value)
    assert "prompt 1 (prompt_id " in msg and f"is {n} tokens" in msg
    assert f"context is {POSITIONS}" in msg and "prompt_overflow" in msg
    assert "\n" not in msg
    assert store.count() == 0  # refused before anything was sampled or written


def test_skip_leaves_the_prompt_out_and_counts_it(store, gen):
    with pytest.warns(PromptOverflowWarning, match="1 of 2 prompts were left out"):
        summary = _round(store, gen, "skip")
    assert summary.prompts_skipped == 1 and summary.prompts_truncated == 0
    rows = store.sql("SELECT prompt_text FROM rollouts").to_pylist()
    assert [r["prompt_text"] for r in rows] == [SHORT.prompt_text] * 2


def test_truncate_left_keeps_the_end_and_fits(store, gen):
    with pytest.warns(PromptOverflowWarning, match="cut from the left"):
        summary = _round(store, gen, "truncate_left")
    assert summary.prompts_truncated == 1 and summary.rollouts == 4
    rows = store.sql(
        "SELECT prompt_text, prompt_ids FROM rollouts WHERE prompt_text != ?",
        [SHORT.prompt_text],
    ).to_pylist()
    assert len(rows) == 2
    text, ids = rows[0]["prompt_text"], rows[0]["prompt_ids"]
    assert LONG.prompt_text.endswith(text) and text.endswith("Answer:")
    assert len(ids) + MAX_TOKENS <= POSITIONS
    assert ids == encode_prompt(gen.tokenizer, text)  # the stored text is what was encoded


def test_truncate_left_refuses_chat_rendered_prompts(gen):
    chat = Prompt("hi", "1", messages=({"role": "user", "content": "hi"},))
    with pytest.raises(TaskError, match="plain-text prompts only, and prompt 0 is chat"):
        fit_prompts(gen.tokenizer, [chat], max_tokens=8, limit=64, policy="truncate_left")


def test_generator_refuses_an_overlong_prompt_without_the_pipeline(gen):
    with pytest.raises(PromptTooLongError, match=f"context is {POSITIONS}"):
        gen.generate([LONG.prompt_text], group_size=1, max_tokens=MAX_TOKENS)
    with pytest.raises(PromptTooLongError):  # a multi-turn context too
        gen.sample([[1] * (POSITIONS - 2)], max_tokens=4)


def test_config_refuses_an_unknown_policy():
    with pytest.raises(ConfigError, match=r"\[generation\]\.prompt_overflow = 'cut'"):
        GenerationConfig(prompt_overflow="cut")


class _HeldOut(ArithTask):
    """Arith whose eval split is fixed: the short prompt, then the long one."""

    def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        return [SHORT, LONG][:n]


def _eval(gen, policy: str, task=None):
    g = GenerationConfig(group_size=2, max_tokens=MAX_TOKENS, prompt_overflow=policy)
    return evaluate(gen, task or _HeldOut(), EvalConfig(prompts=2, greedy=True), g, seed=0)


def test_eval_skips_what_generation_skips_and_reports_it(gen):
    with pytest.warns(PromptOverflowWarning, match="1 of 2 prompts were left out.*eval record"):
        result = _eval(gen, "skip")
    assert result.prompts == 1 and result.prompts_skipped == 1 and result.prompts_truncated == 0
    record = result.record()
    assert record["eval_prompts"] == 1 and record["eval_prompts_skipped"] == 1
    assert "1 too long, skipped" in result.line()


def test_eval_cuts_what_generation_cuts(gen):
    with pytest.warns(PromptOverflowWarning, match="cut from the left"):
        result = _eval(gen, "truncate_left")
    assert result.prompts == 2 and result.prompts_truncated == 1 and result.prompts_skipped == 0
    assert result.record()["eval_prompts_truncated"] == 1


def test_eval_refuses_an_overlong_prompt_under_error(gen):
    with pytest.raises(PromptTooLongError, match=f"prompt 1 .*context is {POSITIONS}"):
        _eval(gen, "error")


def test_eval_with_no_prompt_that_fits_says_so(gen):
    class _AllLong(ArithTask):
        def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
            return [LONG] * n

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptOverflowWarning)
        with pytest.raises(PromptTooLongError, match="all 2 eval prompts are too long"):
            _eval(gen, "skip", _AllLong())


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet="0123456789 +-*=.:abcXYZ\n", min_size=1, max_size=300),
    budget=st.integers(2, 40),
)
def test_left_cut_is_a_fitting_suffix(gen, text, budget):
    tok = gen.tokenizer
    try:
        cut = _left_cut(tok, text, budget, 0)
    except PromptTooLongError:
        # Only when not even the last character fits.
        assert len(encode_prompt(tok, text[-1:])) > budget
        return
    assert cut and text.endswith(cut)
    assert len(encode_prompt(tok, cut)) <= budget


def test_vllm_uses_its_max_model_len(tmp_path, model_dir):
    require_vllm()
    from trainer.rollout.vllm import VLLMGenerator

    store = RolloutStore.open(tmp_path / "store")
    limit = 40  # below the model's 64 positions: the engine's limit is the one that holds
    n_short = None
    with VLLMGenerator(model_dir, max_model_len=limit, enforce_eager=True) as vgen:
        n_short = len(encode_prompt(vgen.tokenizer, SHORT.prompt_text))
        with pytest.raises(PromptTooLongError, match=f"context is {limit}"):
            _round(store, vgen, "error")
        with pytest.warns(PromptOverflowWarning):
            summary = _round(store, vgen, "skip")
    assert n_short + MAX_TOKENS <= limit
    assert summary.prompts_skipped == 1 and store.count() == 2


# -- the learner's micro_batch_tokens and the model's positions ---------------------------------
def _learner_store(tmp_path, lengths: list[int]) -> RolloutStore:
    rng = np.random.default_rng(0)
    rows = []
    for i, n in enumerate(lengths):
        c = n - 4
        rows.append(
            {
                "run_id": "t",
                "group_id": f"g{i // 2}",
                "sample_index": i % 2,
                "policy_version": 0,
                "prompt_ids": rng.integers(20, 90, 4).tolist(),
                "completion_ids": rng.integers(10, 20, c).tolist(),
                "behavior_logprobs": (-rng.exponential(1.0, c)).astype(np.float32).tolist(),
                "reward": float(i % 2),
                "advantage": float(i % 2) - 0.5,
                "temperature": 1.0,
            }  # fmt: skip
        )
    s = RolloutStore.open(tmp_path / "store")
    s.append(rows)
    return s


def _tiny_learner(budget: int | None) -> Learner:
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=POSITIONS,
    )  # fmt: skip
    torch.manual_seed(0)
    return Learner(
        Qwen2ForCausalLM(cfg).float(), LossConfig(), OptimConfig(lr=1e-3, micro_batch_tokens=budget)
    )


def _all_rows(store) -> dict:
    ds = ReplayDataset(
        store, ReplayConfig(seed=0, replacement=False), batch_size=store.count(), steps=1,
        record_usage=False, prefetch=0,
    )  # fmt: skip
    return next(iter(ds))


def test_a_row_over_micro_batch_tokens_is_trained_alone_counted_and_warned_once(tmp_path):
    store = _learner_store(tmp_path, [10, 12, 50, 9, 11, 48, 10, 10])
    batch = _all_rows(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mbs, _, _ = _tiny_learner(budget=30)._micro_batches(batch)
    for mb in mbs:  # each long row alone; the rest within the budget
        n = mb["attention_mask"].sum(dim=1)
        assert (len(n) == 1 and n[0] > 30) or int(n.sum()) <= 30
    learner = _tiny_learner(budget=30)
    with pytest.warns(MicroBatchBudgetWarning, match="2 sequence.* longer than .*= 30") as w:
        m1 = learner.step(batch)
        m2 = learner.step(batch)
    assert len([x for x in w if x.category is MicroBatchBudgetWarning]) == 1
    assert m1["rows_over_micro_budget"] == m2["rows_over_micro_budget"] == 2
    assert _tiny_learner(budget=None).step(batch)["rows_over_micro_budget"] == 0


def test_a_row_beyond_the_model_positions_is_refused_by_rollout_id(tmp_path):
    store = _learner_store(tmp_path, [10, POSITIONS + 6])
    batch = _all_rows(store)
    long_id = store.sql("SELECT rollout_id FROM rollouts WHERE num_completion_tokens > 20")
    with pytest.raises(ValueError) as info:
        _tiny_learner(budget=None).step(batch)
    msg = str(info.value)
    assert f"rollout_id {long_id['rollout_id'][0].as_py()} is {POSITIONS + 6} tokens" in msg
    assert f"{POSITIONS} positions" in msg and "max_tokens_per_batch" in msg


# -- a run's train records: rows trained, and what the token budget cut --------------------------
def test_a_shrunk_batch_is_a_train_metric_and_one_warning(tmp_path):
    run = with_eval(
        resumable_run_toml("shrunk", "batch_size = 8\nmax_tokens_per_batch = 60"), every=0
    )
    cfg = TrainConfig.from_dict(tomllib.loads(run.format(dir=tmp_path / "run", steps=3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, progress=False)
    assert len([w for w in caught if w.category is ShrunkBatchWarning]) == 1
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert len(recs) == 3
    for r in recs:
        assert 1 <= r["batch_rows"] < 8 and r["batch_rows"] + r["batch_shrunk"] == 8
        assert r["rows_over_budget"] == 0 and r["rows_over_micro_budget"] == 0
    gen = [r for r in map(json.loads, lines) if r["kind"] == "generate"]
    assert gen and all(r["prompts_skipped"] == r["prompts_truncated"] == 0 for r in gen)
