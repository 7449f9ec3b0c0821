"""Tests for trainer.tasks: prompt generation, verifiers and the registry.

Run: .venv/bin/python -m pytest -q tests/trainer/test_tasks.py
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.tasks import (
    ArithConfig,
    CountdownConfig,
    FileTask,
    Prompt,
    RewardResult,
    Task,
    available_tasks,
    get_task,
    register_task,
)
from trainer.tasks.parsing import UnsafeExpressionError, extract_tagged, last_int, safe_eval


def _arith_prompt(answer: str = "127") -> Prompt:
    return Prompt(prompt_text="Compute 37+45*2. Answer:", answer=answer, meta={})


def _countdown_prompt() -> Prompt:
    return Prompt(
        prompt_text="Using 3, 7, 25, 50 reach 75. Use each at most once. Answer:",
        answer="50+25",
        meta={"numbers": [3, 7, 25, 50], "target": 75},
    )


# --- registry ---------------------------------------------------------------------------------


def test_registry_lists_builtin_tasks_and_rejects_unknown() -> None:
    assert {"arith", "countdown", "file"} <= set(available_tasks())
    assert isinstance(get_task("arith"), Task)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_register_task_adds_factory_and_refuses_duplicates() -> None:
    class Constant(Task):
        name = "test_constant"

        def make_prompts(self, n: int, seed: int) -> list[Prompt]:
            return [Prompt("q", "a")] * n

        def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
            return RewardResult(1.0)

    register_task("test_constant", Constant)
    assert get_task("test_constant").make_prompts(2, 0) == [Prompt("q", "a")] * 2
    with pytest.raises(ValueError, match="already registered"):
        register_task("test_constant", Constant)


# --- parsing helpers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42", 42),
        ("37-45", 45),  # a minus between digits is an operator, not a sign
        ("= -12.", -12),
        ("1 then 2 then 3", 3),
        ("no digits here", None),
        ("9" * 100, None),  # absurdly long literals are not parsed
    ],
)
def test_last_int(text: str, expected: int | None) -> None:
    assert last_int(text) == expected


def test_extract_tagged_takes_last_block() -> None:
    assert extract_tagged("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_tagged("<answer>unterminated") is None


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('echo pwned')",
        "2**10",
        "7%3",
        "-5+10",  # unary minus is outside the whitelist
        "True+1",
        "1.5*2",
        "x+1",
        "(lambda: 1)()",
        "[1,2]",
        "1 if 1 else 2",
        "(" * 200 + "1" + ")" * 200,
    ],
)
def test_safe_eval_rejects_non_whitelisted(expr: str) -> None:
    with pytest.raises(UnsafeExpressionError):
        safe_eval(expr)


def test_safe_eval_is_exact() -> None:
    assert safe_eval("(50-25)*3") == 75
    assert safe_eval("1/3*3") == 1  # floats would give 0.9999999999999999 on some orders
    with pytest.raises(ZeroDivisionError):
        safe_eval("1/(2-2)")


# --- arith ------------------------------------------------------------------------------------


def test_arith_prompts_are_seeded_and_answers_match_precedence() -> None:
    task = get_task("arith", min_operands=3, max_operands=3, max_digits=3)
    a, b = task.make_prompts(50, seed=7), task.make_prompts(50, seed=7)
    assert a == b
    assert a != task.make_prompts(50, seed=8)
    for p in a:
        assert p.prompt_text.startswith("Compute ") and p.prompt_text.endswith(". Answer:")
        expr = p.meta["expression"]
        assert expr.count("+") + expr.count("-") + expr.count("*") == 2
        assert int(p.answer) == safe_eval(expr)


def test_arith_respects_configured_ops() -> None:
    for p in get_task("arith", ops=("*",)).make_prompts(30, seed=0):
        assert "+" not in p.meta["expression"] and "-" not in p.meta["expression"]


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("127", 1.0),
        ("37+45*2 = 127", 1.0),
        ("<answer>127</answer>", 1.0),
        ("<answer>127</answer> wait, maybe 128", 1.0),  # tags win over trailing text
        ("<answer>128</answer> but really 127", 0.0),
        ("164", 0.0),  # left-to-right evaluation is wrong
        ("I think 127 or maybe 128", 0.0),  # the last number counts
        ("", 0.0),
        ("no idea", 0.0),
        ("<answer></answer>", 0.0),
    ],
)
def test_arith_reward_cases(completion: str, reward: float) -> None:
    assert get_task("arith").reward(_arith_prompt(), completion).reward == reward


def test_arith_format_component() -> None:
    task = get_task("arith", format_bonus=0.1, no_number_penalty=0.2)
    p = _arith_prompt()
    assert task.reward(p, "<answer>127</answer>").reward == pytest.approx(1.1)
    assert task.reward(p, "<answer>5</answer>").reward == pytest.approx(0.1)
    assert task.reward(p, "127").reward == pytest.approx(1.0)
    assert task.reward(p, "pass").reward == pytest.approx(-0.2)
    assert task.reward(p, "pass").info["parsed"] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_operands": 1}, "min_operands"),
        ({"min_operands": 3, "max_operands": 2}, "max_operands"),
        ({"ops": ("/",)}, "unsupported ops"),
        ({"ops": "+-"}, "ops must be"),
        ({"max_digits": 10}, "max_digits"),
        ({"format_bonus": -1.0}, "format_bonus"),
    ],
)
def test_arith_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArithConfig(**kwargs)


# --- countdown --------------------------------------------------------------------------------


def test_countdown_witness_answers_always_score_one() -> None:
    task = get_task("countdown")
    prompts = task.make_prompts(200, seed=3)
    assert prompts == task.make_prompts(200, seed=3)
    for p in prompts:
        assert len(p.meta["numbers"]) == 4
        assert 10 <= p.meta["target"] <= 999
        assert f"reach {p.meta['target']}." in p.prompt_text
        assert task.reward(p, p.answer).reward == 1.0, p


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("50+25", 1.0),
        ("<answer>(50 + 25)</answer>", 1.0),
        ("Let me think.\n50 + 25 = 75", 1.0),
        ("3*25", 1.0),
        ("(50/25+7-3)*25-75", 0.0),  # 25 and 75 reuse / use unavailable numbers
        ("25+25+25", 0.0),  # 25 used three times
        ("50+25+3-3", 0.0),  # 3 used twice
        ("50+7", 0.0),  # wrong value
        ("50/0", 0.0),
        ("", 0.0),
        ("50 + twenty-five", 0.0),
        ("__import__('os').system('touch /tmp/pwned')", 0.0),
        ("<answer>().__class__.__bases__[0].__subclasses__()</answer>", 0.0),
        ("75", 0.0),  # the target itself is not one of the numbers
    ],
)
def test_countdown_reward_cases(completion: str, reward: float) -> None:
    assert get_task("countdown").reward(_countdown_prompt(), completion).reward == reward


def test_countdown_adversarial_input_is_never_executed(tmp_path) -> None:
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    result = get_task("countdown").reward(_countdown_prompt(), payload)
    assert result.reward == 0.0
    assert "not allowed" in result.info["error"]
    assert not marker.exists()


def test_countdown_allows_exact_fraction_steps() -> None:
    p = Prompt("", "", {"numbers": [3, 7, 25, 50], "target": 14})
    # 7 / (25/50) = 14 needs exact rational arithmetic.
    assert get_task("countdown").reward(p, "7/(25/50)").reward == 1.0


def test_countdown_config_validation() -> None:
    with pytest.raises(ValueError, match="num_numbers"):
        CountdownConfig(num_numbers=1)
    with pytest.raises(ValueError, match="min_target"):
        CountdownConfig(min_target=50, max_target=10)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_countdown_reward_never_raises(text: str) -> None:
    result = get_task("countdown").reward(_countdown_prompt(), text)
    assert result.reward in (0.0, 1.0)


# --- file -------------------------------------------------------------------------------------


def _write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_file_task_jsonl_exact_reward_and_meta(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, [{"prompt": "Capital of France?", "answer": "Paris", "id": 1}])
    task = get_task("file", path=path, reward="exact")
    (p,) = task.make_prompts(1, seed=0)
    assert p == Prompt("Capital of France?", "Paris", {"id": 1})
    assert task.reward(p, " Paris\n").reward == 1.0
    assert task.reward(p, "<answer>Paris</answer>").reward == 1.0
    assert task.reward(p, "It is Paris").reward == 0.0


@pytest.mark.parametrize(
    ("reward", "completion", "expected"),
    [
        ("contains", "I believe it is 42 indeed", 1.0),
        ("contains", "41", 0.0),
        ("last_int", "so 40+2 = 42", 1.0),
        ("last_int", "42 or 43", 0.0),
        ("last_int", "<answer>42</answer> not 7", 1.0),
        ("exact", "42", 1.0),
        ("exact", "042", 0.0),
    ],
)
def test_file_reward_functions(tmp_path, reward: str, completion: str, expected: float) -> None:
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, [{"prompt": "q", "answer": 42}])
    task = get_task("file", path=path, reward=reward)
    assert task.reward(task.make_prompts(1, 0)[0], completion).reward == expected


def test_file_task_parquet_with_renamed_fields(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    table = pa.table({"question": [f"q{i}" for i in range(5)], "gold": [str(i) for i in range(5)]})
    pq.write_table(table, path)
    task = FileTask(path, reward="exact", prompt_field="question", answer_field="gold")
    assert len(task) == 5
    prompts = task.make_prompts(12, seed=1)
    assert len(prompts) == 12
    # Whole shuffled passes first: the first five cover the file exactly once.
    assert sorted(p.prompt_text for p in prompts[:5]) == [f"q{i}" for i in range(5)]
    assert prompts == task.make_prompts(12, seed=1)
    assert all(task.reward(p, p.answer).reward == 1.0 for p in prompts)


def test_file_task_errors(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    _write_jsonl(path, [{"prompt": "q"}])
    with pytest.raises(ValueError, match="lacks field"):
        FileTask(path)
    _write_jsonl(path, [{"prompt": "q", "answer": "a"}])
    with pytest.raises(ValueError, match="unknown reward 'fuzzy'"):
        FileTask(path, reward="fuzzy")
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        FileTask(tmp_path / "bad.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported prompt file type"):
        FileTask(tmp_path / "p.csv")


def test_prompt_and_count_validation() -> None:
    with pytest.raises(ValueError, match="answer must be a str"):
        Prompt("q", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        get_task("arith").make_prompts(-1, 0)
