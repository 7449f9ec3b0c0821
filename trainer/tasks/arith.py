"""``arith``: seeded integer-arithmetic prompts ("Compute 37+45*2. Answer:") with an exact verifier.

The reference answer follows ordinary precedence (``*`` before ``+``/``-``). The verifier reads
the content of the last ``<answer>...</answer>`` block if there is one, otherwise the whole
completion, and takes the last integer in it. Reward is 1.0 for an exact match and 0.0 otherwise,
plus an optional format component (a bonus for using ``<answer>`` tags, a penalty when no number
can be found at all). Use it as ``get_task("arith", max_digits=3)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trainer.tasks.base import Prompt, RewardResult, Task, check_count
from trainer.tasks.parsing import extract_tagged, last_int, safe_eval

_ALLOWED_OPS = frozenset("+-*")


@dataclass(frozen=True)
class ArithConfig:
    """How arith prompts are drawn and how the format component is weighted.

    ``format_bonus`` is added when the answer sits in ``<answer>`` tags and ``no_number_penalty``
    subtracted when the completion contains no integer; both default to 0 so the reward is the
    plain 0/1 correctness signal unless shaping is asked for.
    """

    min_operands: int = 2
    max_operands: int = 3
    ops: tuple[str, ...] = ("+", "-", "*")
    min_digits: int = 1
    max_digits: int = 2
    format_bonus: float = 0.0
    no_number_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.min_operands < 2:
            raise ValueError(f"min_operands must be >= 2, got {self.min_operands}")
        if self.max_operands < self.min_operands:
            raise ValueError(
                f"max_operands ({self.max_operands}) must be >= min_operands ({self.min_operands})"
            )
        # A string like "+-" would silently be iterated char by char; demand a real sequence.
        if isinstance(self.ops, str) or not self.ops:
            raise ValueError(f"ops must be a non-empty tuple of operators, got {self.ops!r}")
        bad = [op for op in self.ops if op not in _ALLOWED_OPS]
        if bad:
            raise ValueError(f"unsupported ops {bad}; allowed: {sorted(_ALLOWED_OPS)}")
        if self.min_digits < 1:
            raise ValueError(f"min_digits must be >= 1, got {self.min_digits}")
        if self.max_digits < self.min_digits or self.max_digits > 9:
            raise ValueError(
                f"max_digits must be in [min_digits={self.min_digits}, 9], got {self.max_digits}"
            )
        if self.format_bonus < 0:
            raise ValueError(f"format_bonus must be >= 0, got {self.format_bonus}")
        if self.no_number_penalty < 0:
            raise ValueError(f"no_number_penalty must be >= 0, got {self.no_number_penalty}")


class ArithTask(Task):
    """Integer arithmetic with an exact-answer verifier; see the module docstring."""

    name = "arith"

    def __init__(self, config: ArithConfig | None = None, **overrides: object) -> None:
        if config is not None and overrides:
            raise ValueError("pass either config or keyword overrides, not both")
        if "ops" in overrides and isinstance(overrides["ops"], list):
            overrides["ops"] = tuple(overrides["ops"])
        self.config = config if config is not None else ArithConfig(**overrides)  # type: ignore[arg-type]

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        check_count(n)
        cfg = self.config
        # A private Random keeps generation independent of any global RNG state.
        rng = random.Random(f"arith:{seed}")
        prompts = []
        for _ in range(n):
            k = rng.randint(cfg.min_operands, cfg.max_operands)
            operands = []
            for _ in range(k):
                digits = rng.randint(cfg.min_digits, cfg.max_digits)
                lo = 0 if digits == 1 else 10 ** (digits - 1)
                operands.append(rng.randint(lo, 10**digits - 1))
            ops = [rng.choice(cfg.ops) for _ in range(k - 1)]
            expr = str(operands[0]) + "".join(f"{o}{v}" for o, v in zip(ops, operands[1:]))
            value = safe_eval(expr)
            prompts.append(
                Prompt(
                    prompt_text=f"Compute {expr}. Answer:",
                    answer=str(int(value)),
                    meta={"expression": expr},
                )
            )
        return prompts

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        cfg = self.config
        tagged = extract_tagged(completion_text)
        parsed = last_int(tagged if tagged is not None else completion_text)
        correct = parsed is not None and str(parsed) == prompt.answer.strip()
        fmt = 0.0
        if parsed is None:
            fmt -= cfg.no_number_penalty
        elif tagged is not None:
            fmt += cfg.format_bonus
        return RewardResult(
            reward=float(correct) + fmt,
            info={
                "parsed": parsed,
                "correct": correct,
                "tagged": tagged is not None,
                "format": fmt,
            },
        )
