"""``countdown``: reach a target from given numbers with ``+ - * /``, each number used at most once.

Prompts look like "Using 3, 7, 25, 50 reach 75. Use each at most once. Answer:" and every
generated instance is solvable (the target is built from a random subset of the numbers; the
witness expression is stored as ``Prompt.answer``). The verifier takes the content of the last
``<answer>`` block, or else the last non-empty line, drops anything from the first ``=`` on, and
parses the rest with :func:`trainer.tasks.parsing.parse_arith` (an ``ast`` whitelist; nothing is
ever executed). Reward 1.0 iff the value equals the target exactly and the multiset of literals is
contained in the given numbers. Use it as ``get_task("countdown", num_numbers=4)``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from trainer.tasks.base import Prompt, RewardResult, Task, check_count
from trainer.tasks.parsing import (
    UnsafeExpressionError,
    arith_constants,
    eval_arith,
    extract_tagged,
    parse_arith,
)

_MAX_TRIES = 1000


@dataclass(frozen=True)
class CountdownConfig:
    """Shape of countdown instances and the optional format shaping (off by default)."""

    num_numbers: int = 4
    small_numbers: tuple[int, ...] = tuple(range(1, 11))
    large_numbers: tuple[int, ...] = (25, 50, 75, 100)
    max_large: int = 2
    min_target: int = 10
    max_target: int = 999
    format_bonus: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.num_numbers <= 8:
            raise ValueError(f"num_numbers must be in [2, 8], got {self.num_numbers}")
        if not self.small_numbers or any(int(v) < 1 for v in self.small_numbers):
            raise ValueError(f"small_numbers must be positive ints, got {self.small_numbers!r}")
        if any(int(v) < 1 for v in self.large_numbers):
            raise ValueError(f"large_numbers must be positive ints, got {self.large_numbers!r}")
        if self.max_large < 0:
            raise ValueError(f"max_large must be >= 0, got {self.max_large}")
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError(
                f"need 1 <= min_target <= max_target, got {self.min_target}, {self.max_target}"
            )
        if self.format_bonus < 0:
            raise ValueError(f"format_bonus must be >= 0, got {self.format_bonus}")


def _candidate_expression(completion_text: str) -> str:
    tagged = extract_tagged(completion_text)
    if tagged is not None:
        text = tagged
    else:
        lines = [ln for ln in completion_text.strip().splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    # "(50-25)*3 = 75" states the value too; only the left-hand side is the solution.
    text = text.split("=", 1)[0]
    return text.strip().rstrip(".").strip()


class CountdownTask(Task):
    """Countdown numbers game with a safe, exact verifier; see the module docstring."""

    name = "countdown"

    def __init__(self, config: CountdownConfig | None = None, **overrides: object) -> None:
        if config is not None and overrides:
            raise ValueError("pass either config or keyword overrides, not both")
        for key in ("small_numbers", "large_numbers"):
            if isinstance(overrides.get(key), list):
                overrides[key] = tuple(overrides[key])  # type: ignore[arg-type]
        self.config = config if config is not None else CountdownConfig(**overrides)  # type: ignore[arg-type]

    def _draw(self, rng: random.Random) -> tuple[list[int], int, str] | None:
        cfg = self.config
        n_large = rng.randint(0, min(cfg.max_large, cfg.num_numbers, len(cfg.large_numbers)))
        numbers = rng.sample(list(cfg.large_numbers), n_large) if n_large else []
        numbers += [rng.choice(cfg.small_numbers) for _ in range(cfg.num_numbers - n_large)]
        rng.shuffle(numbers)
        # Fold a random subset left to right, keeping every intermediate a positive integer so
        # the witness is a natural solution (no fractions, no negative detours).
        used = rng.sample(numbers, rng.randint(2, len(numbers)))
        value, expr = Fraction(used[0]), str(used[0])
        for v in used[1:]:
            options = [("+", value + v), ("*", value * v)]
            if value - v > 0:
                options.append(("-", value - v))
            if value % v == 0:
                options.append(("/", value / v))
            op, new_value = rng.choice(options)
            expr = f"({expr}){op}{v}" if op in "*/" and not expr.isdigit() else f"{expr}{op}{v}"
            value = new_value
        target = int(value)
        if not self.config.min_target <= target <= self.config.max_target:
            return None
        return numbers, target, expr

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        check_count(n)
        rng = random.Random(f"countdown:{seed}")
        prompts = []
        for _ in range(n):
            for _ in range(_MAX_TRIES):
                drawn = self._draw(rng)
                if drawn is not None:
                    break
            else:
                raise ValueError(
                    f"could not draw a target in [{self.config.min_target}, "
                    f"{self.config.max_target}] after {_MAX_TRIES} tries; widen the range"
                )
            numbers, target, expr = drawn
            listed = ", ".join(str(v) for v in numbers)
            prompts.append(
                Prompt(
                    prompt_text=f"Using {listed} reach {target}. Use each at most once. Answer:",
                    answer=expr,
                    meta={"numbers": numbers, "target": target},
                )
            )
        return prompts

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        numbers = [int(v) for v in prompt.meta["numbers"]]
        target = int(prompt.meta["target"])
        tagged = extract_tagged(completion_text) is not None
        fmt = self.config.format_bonus if tagged else 0.0
        expr = _candidate_expression(completion_text)
        info: dict[str, object] = {"expression": expr, "tagged": tagged, "format": fmt}
        try:
            tree = parse_arith(expr)
            used = arith_constants(tree)
            value = eval_arith(tree)
        except UnsafeExpressionError as exc:
            return RewardResult(reward=fmt, info={**info, "correct": False, "error": str(exc)})
        except ZeroDivisionError:
            return RewardResult(
                reward=fmt, info={**info, "correct": False, "error": "division by zero"}
            )
        overused = Counter(used) - Counter(numbers)
        if overused:
            return RewardResult(
                reward=fmt,
                info={
                    **info,
                    "correct": False,
                    "error": f"numbers not available: {sorted(overused.elements())}",
                },
            )
        correct = value == target
        info.update(correct=correct, value=str(value))
        return RewardResult(reward=float(correct) + fmt, info=info)
