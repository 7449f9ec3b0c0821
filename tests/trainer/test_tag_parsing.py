"""Tag parsing in linear time (issue 31, item 8): ``extract_tagged`` (``<answer>``) and
``ToolEnv.model_text`` (``<calc>`` / ``<result>`` blocks) give what their old regexes gave on
any text, kept below as oracles, without the regexes' rescan to the end of the text from every
unclosed tag (a megabyte of ``<answer>`` took minutes); and a reward reads at most
``MAX_SCORED_CHARS`` characters of a completion."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from trainer.store_commands import task_scorer
from trainer.tasks import MAX_SCORED_CHARS, Prompt, RewardResult, Task, get_task, score_completion
from trainer.tasks.parsing import extract_tagged, replace_blocks, tagged_blocks
from trainer.tasks.tools import RESULT_CLOSE, RESULT_OPEN, ToolEnv, ToolTask

MB = 1_000_000


# -- the old regexes: the oracles ------------------------------------------------------------
def old_extract_tagged(text: str) -> str | None:
    matches = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return matches[-1].strip() if matches else None


def old_replace_blocks(text: str, tags, repl: str) -> str:
    spans = "|".join(f"{re.escape(o)}.*?{re.escape(c)}" for o, c in tags)
    return re.compile(spans, re.DOTALL).sub(lambda _m: repl, text)


def old_model_text(text: str) -> str:
    return old_replace_blocks(text, [("<calc>", "</calc>"), (RESULT_OPEN, RESULT_CLOSE)], "\n")


# -- identical results on tag soup -----------------------------------------------------------
ANSWER_SOUP = ["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">", " 12 ", "-3", "\n"]
TOOL_SOUP = ["<calc>", "</calc>", "<result>", "</result>", "<calc", "</result", "<", ">", "1+2"]
TOOL_SOUP += ["=3", " ", "\n", "<answer>7</answer>"]


def soup(pieces: list[str], max_size: int = 40):
    return st.lists(st.sampled_from(pieces) | st.text("ab<>/\n", max_size=3), max_size=max_size)


@settings(max_examples=400, deadline=None)
@given(soup(ANSWER_SOUP))
def test_extract_tagged_is_the_old_regex_on_tag_soup(parts: list[str]) -> None:
    text = "".join(parts)
    assert extract_tagged(text) == old_extract_tagged(text)


@settings(max_examples=400, deadline=None)
@given(soup(TOOL_SOUP))
def test_model_text_is_the_old_regex_on_tag_soup(parts: list[str]) -> None:
    text = "".join(parts)
    assert ToolEnv(["calculator"]).model_text(text) == old_model_text(text)


TAG = st.text("ab<", min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(st.text("ab<", max_size=30), st.lists(st.tuples(TAG, TAG), min_size=1, max_size=3))
def test_replace_blocks_is_the_regex_alternation_for_any_tags(text: str, tags) -> None:
    """Overlapping tags, tags that are prefixes of each other, one tag opening and closing:
    the regex alternation tried in order at each position, block by block."""
    assert replace_blocks(text, tags, "|") == old_replace_blocks(text, tags, "|")


@settings(max_examples=300, deadline=None)
@given(st.text("ab<", max_size=30), TAG, TAG)
def test_tagged_blocks_are_the_regex_matches_for_any_tags(text: str, open_: str, close: str):
    rx = re.compile(f"{re.escape(open_)}(.*?){re.escape(close)}", re.DOTALL)
    assert list(tagged_blocks(text, open_, close)) == [m.span(1) for m in rx.finditer(text)]


def test_normal_completions_parse_as_before() -> None:
    env = ToolEnv(["calculator"])
    text = "Compute 347+589. <calc>347+589</calc><result>=936</result> =936<answer>936</answer>"
    assert env.model_text(text) == "Compute 347+589. \n\n =936<answer>936</answer>"
    assert extract_tagged(text) == "936"
    assert extract_tagged("<answer>a<answer>b</answer>") == "a<answer>b"
    with pytest.raises(ValueError, match="non-empty"):
        replace_blocks("x", [("", ">")], "")


# -- a megabyte of unclosed tags (the old regexes: minutes each) -----------------------------
def test_a_megabyte_of_unclosed_answer_tags_parses() -> None:
    text = "<answer>1</answer>" + "<answer>" * (MB // 8)
    assert extract_tagged(text) == "1"
    assert extract_tagged("<answer>" * (MB // 8) + "</answer") is None


def test_a_megabyte_of_unclosed_tool_tags_is_the_models_text() -> None:
    env = ToolEnv(["calculator"])
    text = "<calc>1+1</calc><result>=2</result> =2 " + "<calc><result>" * (MB // 14)
    assert env.model_text(text) == "\n\n =2 " + "<calc><result>" * (MB // 14)
    task = ToolTask(get_task("arith"), ["calculator"])
    prompt = Prompt("Compute 1+1. Answer:", "2", {"expression": "1+1"})
    result = score_completion(task, prompt, text[: MAX_SCORED_CHARS - 1])
    assert result.reward == 1.0 and result.info["parsed"] == 2


def test_rescore_of_a_stored_megabyte_completion_finishes(tmp_path) -> None:
    task = get_task("arith")
    (prompt,) = task.make_prompts(1, 0)
    store = RolloutStore.open(tmp_path / "s")
    texts = [f"<answer>{prompt.answer}</answer>" + "<answer>" * (MB // 8 - 3), "<calc>" * 9]
    store.append([
        {"rollout_id": f"r{i}", "group_id": "g", "prompt_ids": [1], "completion_ids": [2],
         "behavior_logprobs": [-0.5], "policy_version": 0, "prompt_text": prompt.prompt_text,
         "completion_text": text, "reward": 0.0, "task": "arith",
         "metadata": json.dumps({"answer": prompt.answer, "prompt_meta": prompt.meta})}
        for i, text in enumerate(texts)
    ])  # fmt: skip
    store.rescore(task_scorer("arith"), progress=False)
    rewards = store.sql("SELECT rollout_id, reward FROM rollouts_scored ORDER BY 1").to_pylist()
    assert [r["reward"] for r in rewards] == [1.0, 0.0]


# -- the per-row limit ---------------------------------------------------------------------
class Counting(Task):
    name = "counting"

    def __init__(self) -> None:
        self.read: list[int] = []

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        return [Prompt("p", "x")] * n

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        self.read.append(len(completion_text))
        return RewardResult(1.0, {"correct": True})


def test_a_completion_over_the_limit_is_not_read_and_scores_as_unparseable() -> None:
    task, prompt = Counting(), Prompt("p", "x")
    assert score_completion(task, prompt, "x" * MAX_SCORED_CHARS).reward == 1.0
    over = score_completion(task, prompt, "x" * (MAX_SCORED_CHARS + 1))
    assert over.reward == 0.0 and over.info["correct"] is False and over.info["parsed"] is None
    assert f"longer than the {MAX_SCORED_CHARS}" in over.info["error"]
    assert task.read == [MAX_SCORED_CHARS]
    batch = task.rewards([prompt] * 2, ["x", "x" * (MAX_SCORED_CHARS + 1)])
    assert [r.reward for r in batch] == [1.0, 0.0]
