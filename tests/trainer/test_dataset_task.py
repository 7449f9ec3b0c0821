"""The dataset task (file formats, field mapping, held-out split), its named rewards, chat
templates, and a short training run on a chat-rendered math dataset.

Run: PYTHONPATH=. .venv/bin/python -m pytest -q tests/trainer/test_dataset_task.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.errors import TaskError, TaskFileError
from trainer.store_commands import task_scorer
from trainer.tasks import DatasetTask, Prompt, get_reward, get_task
from trainer.tasks.chat import encode_prompt, render_prompts, uses_chat_template
from trainer.tasks.rewards import _math_builtin, last_boxed, last_number

ROOT = Path(__file__).parents[2]
ROWS = [{"q": f"question {i}?", "a": str(i), "src": f"s{i}"} for i in range(20)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from trainer.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("m") / "tiny", chat_template=True, num_texts=200, num_layers=1
    )


# --- file formats and field mapping ----------------------------------------------------------


def _write(fmt: str, tmp_path: Path) -> Path:
    if fmt == "jsonl":
        return _jsonl(tmp_path / "d.jsonl", ROWS)
    if fmt == "jsonl.zst":
        import zstandard

        path = tmp_path / "d.jsonl.zst"
        text = "".join(json.dumps(r) + "\n" for r in ROWS)
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
        return tmp_path / "d.parquet"
    from datasets import Dataset

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.zst", "parquet", "hf"])
def test_every_format_gives_the_same_prompts(tmp_path, fmt):
    task = get_task("dataset", path=_write(fmt, tmp_path), prompt_field="q", answer_field="a")
    assert len(task) == 20
    prompts = task.make_prompts(20, seed=3)
    assert sorted((p.prompt_text, p.answer, p.meta["src"]) for p in prompts) == sorted(
        (r["q"], r["a"], r["src"]) for r in ROWS
    )
    assert prompts == task.make_prompts(20, seed=3)  # the order is a function of the seed
    assert prompts != task.make_prompts(20, seed=4)


def test_hf_dataset_dict_named_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict(
        {"train": Dataset.from_list(ROWS[:15]), "test": Dataset.from_list(ROWS[15:])}
    ).save_to_disk(str(tmp_path / "dd"))
    task = DatasetTask(tmp_path / "dd", prompt_field="q", answer_field="a", eval_split="test")
    assert len(task) == 15 and task.eval_size == 5
    assert [p.answer for p in task.make_eval_prompts(64, seed=0)] == ["15", "16", "17", "18", "19"]
    with pytest.raises(TaskError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        DatasetTask(tmp_path / "dd", prompt_field="q", answer_field="a", split="validation")


def test_messages_field_and_system_prompt(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": 4},
        # A JSON string (as some exports write it) is read the same way.
        {"messages": json.dumps([{"role": "user", "content": "3+3?"}]), "answer": 6},
    ]
    task = DatasetTask(
        _jsonl(tmp_path / "m.jsonl", rows), messages_field="messages", system_prompt="Be brief."
    )
    p = sorted(task.make_prompts(2, 0), key=lambda p: p.answer)
    assert p[0].prompt_text == "2+2?" and p[0].answer == "4"
    assert p[0].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    )
    text = DatasetTask(_jsonl(tmp_path / "t.jsonl", ROWS[:1]), prompt_field="q", answer_field="a",
                       system_prompt="Be brief.")  # fmt: skip
    assert text.make_prompts(1, 0)[0].messages[0] == {"role": "system", "content": "Be brief."}
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}], "answer": 1}])
    with pytest.raises(TaskError, match=r"record 0, field 'messages'.*str role and content"):
        DatasetTask(bad, messages_field="messages")


def test_held_out_split_is_deterministic_and_disjoint(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)

    def split(seed):
        t = DatasetTask(path, prompt_field="q", answer_field="a", eval_fraction=0.25,
                        split_seed=seed)  # fmt: skip
        train = {p.answer for p in t.make_prompts(200, seed=0)}
        held = [p.answer for p in t.make_eval_prompts(64, seed=0)]
        return train, held

    train, held = split(0)
    assert len(held) == 5 and len(train) == 15 and not train & set(held)
    assert split(0) == (train, held)  # same file + split seed: same held-out records
    assert split(1)[1] != held
    # eval_path: another file with the same fields
    other = _jsonl(tmp_path / "e.jsonl", [{"q": "x", "a": "y"}])
    t = DatasetTask(path, prompt_field="q", answer_field="a", eval_path=other)
    assert t.make_eval_prompts(8, 0) == [Prompt("x", "y", {})] and len(t) == 20
    with pytest.raises(TaskError, match="leaves none to train on"):
        DatasetTask(_jsonl(tmp_path / "one.jsonl", ROWS[:1]), prompt_field="q", answer_field="a",
                    eval_fraction=0.5)  # fmt: skip


# --- rewards ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "completion", "answer", "expected"),
    [
        ("math", r"so the total is \boxed{7}", r"\boxed{7}", 1.0),
        ("math", r"each gets $\frac{3}{4}$", "0.75", 1.0),
        ("math", "It is 3/4 of the cake", r"\frac{3}{4}", 1.0),
        ("math", r"\boxed{1.5}", "3/2", 1.0),
        ("math", r"\boxed{8}", "7", 0.0),
        ("math", "no idea", "7", 0.0),
        ("exact", "<answer>Paris</answer>", "Paris", 1.0),
        ("exact", "It is Paris", "Paris", 0.0),
        ("contains", "I think Paris, France", "Paris", 1.0),
        ("contains", "anything", " ", 0.0),
        ("last_number", "first 2, then 1,000.5", "1000.5", 1.0),
        ("last_number", "it is 6/8", "0.75", 1.0),
        ("last_number", "7 or 8", "7", 0.0),
        ("last_int", "so 40+2 = 42", "42", 1.0),
        (r"regex:answer is (\w+)", "the answer is blue. No, the answer is red", "red", 1.0),
        (r"regex:answer is (\w+)", "the answer is red. No, the answer is blue", "red", 0.0),
        (r"regex:#+\d", "#### 12", "####1", 0.0),
        (r"regex:#+ ?\d+", "#### 12", "#### 12", 1.0),
    ],
)
def test_builtin_rewards(spec, completion, answer, expected):
    result = get_reward(spec)("prompt", completion, answer)
    assert result.reward == expected
    assert result.info["reward_fn"] == spec and result.info["reward_fn_version"]


def test_math_reward_version_names_math_verify_and_the_fallback_agrees():
    from importlib.metadata import version

    assert get_reward("math").version == f"math-verify/{version('math-verify')}"
    # The built-in comparison (used without math-verify) on the forms the generator writes.
    for completion, answer, ok in [
        (r"\boxed{7}", r"\boxed{7}", True),
        (r"\boxed{\frac{3}{4}}", "3/4", True),
        ("0.75", r"\frac{3}{4}", True),
        ("so 1.5 meters", "1.5", True),
        (r"\boxed{2} but 1.5", "1.5", False),
        ("none", "1.5", False),
    ]:
        assert _math_builtin("", completion, answer).reward == float(ok), (completion, answer)
    assert last_boxed(r"\boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert str(last_number(r"1,234 then \frac{6}{4}")) == "3/2"


def test_module_function_rewards(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(
        "from trainer.tasks import RewardResult\n"
        "def score(prompt, completion, answer):\n"
        "    return float(answer in completion) + 0.5 * prompt.startswith('Q')\n"
        "def detailed(prompt, completion, answer):\n"
        "    return RewardResult(2.0, {'why': 'fixed'})\n"
        "detailed.__version__ = '3'\n"
        "def broken(prompt, completion, answer):\n"
        "    return 'yes'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    r = get_reward("my_rewards:score")
    assert r("Q: x", "it is 4", "4").reward == 1.5 and r("x", "it is 5", "4").reward == 0.0
    assert r.version.startswith("src-")
    r2 = get_reward("my_rewards:detailed")
    res = r2("p", "c", "a")
    assert res.reward == 2.0 and res.info == {
        "why": "fixed", "reward_fn": "my_rewards:detailed", "reward_fn_version": "3"
    }  # fmt: skip
    # The task passes the prompt text (what the model saw) and the answer.
    task = DatasetTask(_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q1", "answer": "4"}]),
                       reward="my_rewards:score")  # fmt: skip
    assert task.reward(task.make_prompts(1, 0)[0], "4").reward == 1.5
    assert task.reward_spec == {"name": "my_rewards:score", "version": r.version}
    with pytest.raises(TaskError, match="returned str"):
        get_reward("my_rewards:broken")("p", "c", "a")
    # A path to a file works without PYTHONPATH; editing the function changes its version.
    by_path = get_reward(f"{mod}:score")
    assert by_path.version == r.version
    mod.write_text(mod.read_text().replace("0.5 *", "0.25 *"))
    assert get_reward(f"{mod}:score").version != r.version


def test_errors_name_the_problem(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskFileError, match="no such file or folder"):
        DatasetTask(tmp_path / "missing.jsonl")
    assert issubclass(TaskFileError, FileNotFoundError)
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(
        TaskError, match=r"record 1 lacks field\(s\) \['answer'\]; it has \['prompt'\]"
    ):
        DatasetTask(path)
    with pytest.raises(TaskError, match=r"record 0 lacks field\(s\) \['question'\]"):
        DatasetTask(path, prompt_field="question")
    with pytest.raises(TaskError, match="unknown reward 'fuzzy'"):
        get_reward("fuzzy")
    with pytest.raises(TaskError, match="not a valid regular expression"):
        get_reward("regex:(unclosed")
    with pytest.raises(TaskError, match="module 'no_such_mod' does not import"):
        get_reward("no_such_mod:f")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(TaskError, match="boom"):
        get_reward("raises_on_import:f")
    (tmp_path / "ok_mod.py").write_text("x = 1\n")
    with pytest.raises(TaskError, match="has no function 'f'"):
        get_reward("ok_mod:f")
    with pytest.raises(TaskError, match="no such file"):
        get_reward(f"{tmp_path}/nope.py:f")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(TaskError, match="unsupported prompt file type"):
        DatasetTask(tmp_path / "p.csv")
    with pytest.raises(TaskError, match="at most one of"):
        DatasetTask(path, eval_fraction=0.1, eval_split="test")


# --- chat templates --------------------------------------------------------------------------


def test_chat_rendering_and_modes(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    plain = Prompt("Compute 2+3.", "5")
    chat = Prompt(
        "hi", "x", messages=({"role": "system", "content": "S"}, {"role": "user", "content": "hi"})
    )
    r_plain, r_chat = render_prompts(tok, [plain, chat], "auto")
    assert r_plain.prompt_text == "<|user|>\nCompute 2+3.\n<|assistant|>\n"
    assert r_chat.prompt_text == "<|system|>\nS\n<|user|>\nhi\n<|assistant|>\n"
    assert r_plain.answer == "5" and r_plain.messages == (
        {"role": "user", "content": "Compute 2+3."},
    )
    assert render_prompts(tok, [plain], False) == [plain]
    with pytest.raises(TaskError, match="chat messages, but chat templates are off"):
        render_prompts(tok, [chat], False)
    tok.chat_template = None
    assert not uses_chat_template(tok, "auto") and render_prompts(tok, [plain], "auto") == [plain]
    with pytest.raises(TaskError, match="has no chat template"):
        render_prompts(tok, [plain], True)
    with pytest.raises(ValueError, match="chat_template must be"):
        get_task("arith", chat_template="yes")


def test_encode_prompt_never_doubles_bos(chat_model):
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    # A tokenizer that adds BOS itself, like Llama's; its chat template writes BOS too.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.eos_token_id)]
    )
    tok.bos_token = "<|endoftext|>"
    bos = tok.bos_token_id
    assert encode_prompt(tok, "hi")[:1] == [bos] and encode_prompt(tok, "hi")[1] != bos
    ids = encode_prompt(tok, "<|endoftext|>hi")
    assert (
        ids[0] == bos
        and ids[1] != bos
        and ids == tok("<|endoftext|>hi", add_special_tokens=False)["input_ids"]
    )


# --- the math dataset and a short training run ----------------------------------------------


def test_math_dataset_generator_is_seeded(tmp_path):
    def make(name, seed):
        out = tmp_path / name
        cmd = [sys.executable, str(ROOT / "tools/make_math_dataset.py"), str(out),
               "--problems", "200", "--seed", str(seed)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        return out

    a, b, c = make("a.jsonl", 0), make("b.jsonl", 0), make("c.jsonl", 1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    answers = [r["answer"] for r in rows]
    assert any(r"\boxed{" in x for x in answers) and any(r"\frac{" in x for x in answers)
    assert any("/" in x and "\\" not in x for x in answers) and any("." in x for x in answers)
    reward = get_reward("math")
    assert all(reward(r["question"], f"The answer is {r['answer']}", r["answer"]).reward == 1.0
               for r in rows)  # fmt: skip
    zst = make("d.jsonl.zst", 0)
    assert [p.answer for p in DatasetTask(zst, prompt_field="question").make_prompts(5, 0)] == [
        p.answer for p in DatasetTask(a, prompt_field="question").make_prompts(5, 0)
    ]


def test_math_run_stores_chat_rendered_prompts_and_reward_versions(tmp_path, monkeypatch):
    import tomllib

    from rolloutstore import RolloutStore
    from tools.make_math_dataset import write_dataset
    from trainer.config import TrainConfig
    from trainer.run.sync import train

    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path / "runs/math-data/math.jsonl", 300, seed=0)
    data = tomllib.loads((ROOT / "examples/math.toml").read_text())
    assert data["task"]["options"]["reward"] == "math" and data["task"]["chat_template"] is True
    data["model"].update(num_layers=1)
    data["eval"].update(prompts=4, every=0)
    data["generation"].update(backend="hf", group_size=4, prompts_per_round=4, max_tokens=6)
    data["run"].update(dir=str(tmp_path / "run"), steps=2, batch_size=8, warm_start_steps=0,
                       checkpoint_every=2)  # fmt: skip
    result = train(TrainConfig.from_dict(data), progress=False)
    assert result.steps == 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "run/model-init"))
    assert tok.chat_template  # the tiny model got a chat template because chat_template = true
    store = RolloutStore.open(result.store)
    rows = store.sql(
        "SELECT prompt_text, prompt_ids, reward_info, metadata FROM rollouts"
    ).to_pylist()
    assert len(rows) == 16
    lines = Path("runs/math-data/math.jsonl").read_text().splitlines()
    questions = {json.loads(x)["question"] for x in lines}
    system = data["task"]["options"]["system_prompt"]
    for row in rows:
        body = row["prompt_text"].removeprefix(f"<|system|>\n{system}\n<|user|>\n")
        question = body.removesuffix("\n<|assistant|>\n")
        assert question in questions and question != body != row["prompt_text"]
        expected = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        assert row["prompt_text"] == expected
        assert row["prompt_ids"] == tok(expected)["input_ids"]  # the rendered ids are stored
        info, meta = json.loads(row["reward_info"]), json.loads(row["metadata"])
        assert info["reward_fn"] == "math" and info["reward_fn_version"].startswith("math-verify/")
        assert meta["reward"] == {"name": "math", "version": info["reward_fn_version"]}
        # The turns it was rendered from (what `export --as messages|sft` writes as the prompt).
        assert meta["messages"] == [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
    # Re-scoring from the stored (rendered) prompt and answer reproduces every reward.
    task = TrainConfig.from_dict(data).task.build()
    res = store.rescore(task_scorer(task))
    assert res.rows == 16 and res.changed == 0
