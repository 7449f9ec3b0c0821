"""tools/make_math_dataset.py difficulty options (--kinds, --max-operand), which
examples/math.toml uses so that a tiny model learns on a CPU in minutes (docs/results.md)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tomllib

import pytest
from helpers import ROOT

from tools.make_math_dataset import KINDS, make_problems
from trainer.tasks import get_reward

# sha256 of json.dumps(make_problems(200, 0), sort_keys=True) before the options existed.
DEFAULT_200 = "9dfac5e0c0153f71295c1c91847cf7f63b381151e32d30106f2687a168bd79e2"


def test_defaults_write_what_they_always_wrote():
    blob = json.dumps(make_problems(200, 0), sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest() == DEFAULT_200
    assert make_problems(200, 0, kinds=KINDS, max_operand=None) == make_problems(200, 0)


def test_kinds_and_max_operand_bound_the_problems():
    rows = make_problems(500, 0, kinds=("add", "sub"), max_operand=9)
    assert {r["kind"] for r in rows} == {"add", "sub"}
    reward = get_reward("math")
    for r in rows:
        numbers = [int(x) for x in re.findall(r"\d+", r["question"])]
        assert len(numbers) == 2 and all(1 <= n <= 9 for n in numbers), r
        a, b = numbers
        want = a + b if r["kind"] == "add" else a - b
        assert reward(r["question"], f"\\boxed{{{want}}}", r["answer"]).reward == 1.0, r
    assert {r["kind"] for r in make_problems(50, 1, kinds=("mul",), max_operand=3)} == {"mul"}
    with pytest.raises(ValueError, match="kinds must be some of"):
        make_problems(5, 0, kinds=("add", "div"))
    with pytest.raises(ValueError, match="max operand"):
        make_problems(5, 0, max_operand=1)


def test_the_math_example_names_the_command_that_writes_its_data(tmp_path):
    """examples/math.toml's first comment lines are the commands; its dataset command runs."""
    text = (ROOT / "examples/math.toml").read_text()
    cmd = next(line for line in text.splitlines() if "make_math_dataset.py" in line)
    args = cmd.split("make_math_dataset.py", 1)[1].split()
    assert args[:1] == ["runs/math-data/math.jsonl"] and "--kinds" in args
    data = tomllib.loads(text)
    assert data["task"]["options"]["path"] == args[0]
    out = tmp_path / "math.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/make_math_dataset.py"), str(out), *args[1:]],
        check=True, capture_output=True,
    )  # fmt: skip
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    n = int(args[args.index("--problems") + 1])
    assert len(rows) == n and {r["kind"] for r in rows} == {"add"}
    # The held-out split covers the example's eval prompts.
    assert data["eval"]["prompts"] <= n * data["task"]["options"]["eval_fraction"]
