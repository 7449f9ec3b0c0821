"""``carry_add``: multi-digit addition with a worked, column-by-column answer (16-40 tokens).

The replay sweep (``tools/replay_sweep.py``) needs completions long enough that generation is
a real share of the cost, and a task hard enough that a tiny model starts low (reward
~0.1-0.3 after its warm start) yet can climb. Plain ``arith`` answers are 2-4 tokens, so this
task asks for the carries written out, least significant column first, then the sum::

    Compute 478+356. Answer: 8+6=14 7+5+1=13 4+3+1=8 so 834

The warm start learns that format from ``Prompt.answer``; the reward is arith's (the last
integer of the completion, or of its ``<answer>`` block, must equal the sum), so a wrong
column or a wrong read-back of the columns costs the whole reward. Operands have
``min_digits``..``max_digits`` digits (2..3 by default: most prompts have carries).

Registered with the trainer's task registry on import (``register()``), as ``carry_add``;
``trainer.run.setup.prepare_model`` builds the tiny model with arith's tokenizer for it.
"""

from __future__ import annotations

import random

from trainer.tasks import available_tasks, register_task
from trainer.tasks.arith import ArithTask
from trainer.tasks.base import Prompt, check_count

NAME = "carry_add"


def worked_answer(a: int, b: int) -> str:
    """The column-by-column sum of ``a + b``, e.g. ``"8+6=14 7+5+1=13 4+3+1=8 so 834"``."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, cols = 0, []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        cols.append(f"{x}+{y}+{carry}={s}" if carry else f"{x}+{y}={s}")
        carry = s // 10
    return " ".join(cols) + f" so {a + b}"


class CarryAddTask(ArithTask):
    """Two-operand addition with a worked answer; scored like ``arith`` (see the module doc)."""

    name = NAME

    def __init__(self, min_digits: int = 2, max_digits: int = 3, **scoring: object) -> None:
        super().__init__(
            min_operands=2, max_operands=2, ops=("+",), min_digits=min_digits,
            max_digits=max_digits, **scoring,
        )  # fmt: skip

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        check_count(n)
        cfg = self.config
        rng = random.Random(f"{NAME}:{seed}")
        out = []
        for _ in range(n):
            a, b = (
                rng.randint(10 ** (d - 1), 10**d - 1)
                for d in (rng.randint(cfg.min_digits, cfg.max_digits) for _ in range(2))
            )
            out.append(
                Prompt(
                    prompt_text=f"Compute {a}+{b}. Answer:",
                    answer=worked_answer(a, b),
                    meta={"expression": f"{a}+{b}", "value": a + b},
                )
            )
        return out

    def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        # A separate stream from training prompts (seeds of rounds are small integers).
        return self.make_prompts(n, seed=seed + 7_000_000_019)

    def reward(self, prompt: Prompt, completion_text: str):
        # arith's verifier compares the last integer with Prompt.answer; ours is the worked
        # text, so compare against the value.
        plain = Prompt(prompt.prompt_text, str(prompt.meta["value"]), prompt.meta)
        return super().reward(plain, completion_text)


def register() -> None:
    """Make ``get_task("carry_add", ...)`` available (idempotent)."""
    if NAME not in available_tasks():
        register_task(NAME, CarryAddTask)


register()
