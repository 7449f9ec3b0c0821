"""Tools a model may call between turns, and tasks whose trajectories use them.

The syntax is plain text a tiny byte-level model can learn. The model writes a call and
generation stops at the closing tag; the environment answers with a result block (loss-mask 0
tokens, see trainer/rollout/multiturn.py) and the model continues::

    Compute 347+589. Answer: <calc>347+589</calc><result>=936</result> =936<|endoftext|>
                             ^ model turn 1       ^ tool turn           ^ model turn 2

The calculator evaluates with :func:`trainer.tasks.parsing.safe_eval` (integer literals and
``+ - * /`` only, exact rationals; nothing is executed): an integral value is written as an
integer, another as ``p/q``, both after ``=``, and anything it cannot evaluate as
``<result>error</result>``; it never raises. The ``=`` is there for small models: a value
whose length varies (936, 1525) is copied by looking up the token after a marker seen once
before (an induction head), and a 2-layer model learns that copy from warm-start
demonstrations that restate the result as ``=936``; without the marker the copy depends on
the value's length and the same model does not learn it (docs/results.md).

:class:`ToolTask` wraps a task (``[task] tools = ["calculator"]``): same prompts, and a reward
that scores the model's own text only. Call blocks and result blocks are cut out of the
trajectory text before the wrapped task's verifier reads it, so copying a result into the
answer counts, while a result the model never restated is no answer. Its
:meth:`ToolTask.demonstration` gives the warm start tool-using solutions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from trainer.errors import ConfigError, UnsafeExpressionError
from trainer.tasks.base import Prompt, RewardResult, Task
from trainer.tasks.parsing import MAX_INT_DIGITS, replace_blocks, safe_eval

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR_TEXT = "error"


@dataclass(frozen=True)
class ToolOutput:
    """What the environment appends after a call: the tool's name and the result text."""

    tool_name: str
    text: str


@dataclass(frozen=True)
class Calculator:
    """``<calc>EXPR</calc>`` -> ``<result>VALUE</result>`` over the safe evaluator."""

    name: str = "calculator"
    open_tag: str = "<calc>"
    close_tag: str = "</calc>"

    def run(self, expression: str) -> str:
        """The value of ``expression`` as text, or ``error`` (never an exception)."""
        try:
            value = safe_eval(expression)
        except (UnsafeExpressionError, ZeroDivisionError, ValueError, OverflowError):
            return ERROR_TEXT
        text = _format(value)
        return text if len(text) <= MAX_INT_DIGITS else ERROR_TEXT

    def call(self, expression: str) -> str:
        """The model-side text of a call (used by demonstrations)."""
        return f"{self.open_tag}{expression}{self.close_tag}"


def _format(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


TOOLS: dict[str, Calculator] = {"calculator": Calculator()}


def check_tool_names(names: object) -> tuple[str, ...]:
    """``[task].tools`` validated: a list of known tool names, each once (ConfigError)."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"[task].tools must be a list of tool names, got {names!r}")
    out = tuple(names)
    for name in out:
        if name not in TOOLS:
            raise ConfigError(
                f"[task].tools: unknown tool {name!r}; known tools: {', '.join(sorted(TOOLS))}"
            )
    if len(set(out)) != len(out):
        raise ConfigError(f"[task].tools names a tool twice: {list(out)}")
    return out


class ToolEnv:
    """The environment of a multi-turn rollout: which strings end a model turn, and the answer
    to the call that ended it."""

    def __init__(self, tools: Sequence[str]) -> None:
        self.tools = tuple(TOOLS[n] for n in check_tool_names(tools))
        if not self.tools:
            raise ValueError("a ToolEnv needs at least one tool")
        self._blocks = [(t.open_tag, t.close_tag) for t in self.tools]
        self._blocks.append((RESULT_OPEN, RESULT_CLOSE))

    @property
    def stop_strings(self) -> list[str]:
        """The closing tags: generation stops once the model's turn text contains one."""
        return [t.close_tag for t in self.tools]

    def respond(self, turn_text: str) -> ToolOutput | None:
        """The tool output for the call that ends ``turn_text`` (one model turn's text), or None
        when the turn ends with no closing tag. A closing tag without its opening tag in the
        same turn is answered ``<result>error</result>``."""
        best = None
        for tool in self.tools:
            at = turn_text.find(tool.close_tag)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, tool)
        if best is None:
            return None
        at, tool = best
        opened = turn_text.rfind(tool.open_tag, 0, at)
        args = None if opened < 0 else turn_text[opened + len(tool.open_tag) : at]
        result = ERROR_TEXT if args is None else tool.run(args)
        value = result if result == ERROR_TEXT else "=" + result
        return ToolOutput(tool.name, f"{RESULT_OPEN}{value}{RESULT_CLOSE}")

    def model_text(self, trajectory_text: str) -> str:
        """``trajectory_text`` with every call and result block replaced by a line break: what
        the model stated itself, outside the tools. Linear in the text (a regex over the
        blocks rescanned to the end from every unclosed tag)."""
        return replace_blocks(trajectory_text, self._blocks, "\n")


class ToolTask(Task):
    """``task`` with tools: the same prompts; the reward scores the model's own text only.

    ``demo_tool_fraction``: the share of warm-start demonstrations that call the tool (chosen
    per prompt by a hash of its text, so the same prompts always get the same kind); the rest
    answer directly as the plain warm start does.
    """

    def __init__(self, task: Task, tools: Sequence[str], *, demo_tool_fraction: float = 1.0):
        if isinstance(task, ToolTask):
            raise ValueError("the task already has tools")
        if not 0.0 <= demo_tool_fraction <= 1.0:
            raise ConfigError(f"[task].tool_demos must be in [0, 1], got {demo_tool_fraction!r}")
        self.inner = task
        self.env = ToolEnv(tools)
        self.demo_tool_fraction = float(demo_tool_fraction)
        self.name = task.name
        self.chat_template = task.chat_template
        self.reward_spec = task.reward_spec

    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        return self.inner.make_prompts(n, seed)

    def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        return self.inner.make_eval_prompts(n, seed)

    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        """The wrapped task's reward of the model's own text (call and result blocks removed)."""
        own = self.env.model_text(completion_text)
        result = self.inner.reward(prompt, own)
        calls = sum(completion_text.count(t.close_tag) for t in self.env.tools)
        return RewardResult(result.reward, {**result.info, "tool_calls": calls})

    def demonstration(self, prompt: Prompt) -> list[tuple[str, bool]]:
        """A solution as ``(text, model_written)`` segments for the warm start: a direct
        answer, or (for ``demo_tool_fraction`` of the prompts that carry one) a calculator
        call, its result (not model-written) and the answer. arith's call is the prompt's
        expression and the answer restates the result (`` =936``); countdown's call checks
        the solution expression, which is then the answer."""
        direct = [(" " + prompt.answer, True)]
        if not self._uses_tool(prompt):
            return direct
        tool = self.env.tools[0]
        if "expression" in prompt.meta:
            expression, answer = str(prompt.meta["expression"]), " =" + prompt.answer
        elif "target" in prompt.meta:
            expression, answer = prompt.answer, " " + prompt.answer
        else:
            return direct
        result = self.env.respond(tool.call(expression))
        assert result is not None  # a well-formed call always gets an answer
        return [(" " + tool.call(expression), True), (result.text, False), (answer, True)]

    def _uses_tool(self, prompt: Prompt) -> bool:
        h = hashlib.blake2b(prompt.prompt_text.encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.demo_tool_fraction


def with_tools(task: Task, tools: Sequence[str], *, demo_tool_fraction: float = 1.0) -> Task:
    """``task`` itself when ``tools`` is empty, else a :class:`ToolTask` around it."""
    if not tools:
        return task
    return ToolTask(task, tools, demo_tool_fraction=demo_tool_fraction)
