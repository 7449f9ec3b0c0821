"""Core types shared by every task: prompts, reward results and the ``Task`` base class.

A task produces prompts with a known reference answer and scores completions with a pure,
deterministic reward function (no model, no network, no side effects), so rewards stored next to
rollouts can always be recomputed and audited. Import it as ``from trainer.tasks import Task``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

# Completions longer than this many characters are not read by a reward: :func:`score_completion`
# gives them 0.0 as unparseable. Built-in parsers are linear in the text, but a reward may run
# a user's regex or math-verify over it; a million characters (some 250k tokens) is far more
# than any answer a verifier needs to find, and a row that long is a runaway generation or a
# hostile import, not a solution.
MAX_SCORED_CHARS = 1_000_000


@dataclass(frozen=True)
class Prompt:
    """One task instance: the text fed to the policy and the reference answer it is scored against.

    ``meta`` carries task-specific structured data the verifier needs (e.g. countdown's numbers
    and target) so the reward never has to re-parse ``prompt_text``. ``messages`` (OpenAI-style
    ``{"role", "content"}`` dicts) is set for chat prompts; ``prompt_text`` then holds the last
    user turn until :func:`trainer.tasks.chat.render_prompts` replaces it with the text the
    tokenizer's chat template renders (what the model sees, and what the store records).
    """

    prompt_text: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_text, str):
            raise ValueError(f"prompt_text must be a str, got {type(self.prompt_text).__name__}")
        if not isinstance(self.answer, str):
            raise ValueError(f"answer must be a str, got {type(self.answer).__name__}")
        if self.messages is not None:
            if isinstance(self.messages, (str, dict)) or not self.messages:
                raise ValueError("messages must be a non-empty sequence of {role, content} dicts")
            for k, m in enumerate(self.messages):
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                ):
                    raise ValueError(
                        f"messages[{k}] must be a dict with str role and content: {m!r}"
                    )
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


@dataclass(frozen=True)
class RewardResult:
    """A scalar reward plus a JSON-serialisable explanation (parsed answer, error, components)."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """A source of prompts with a verifiable reward.

    Subclasses set ``name`` and implement :meth:`make_prompts` (deterministic in ``seed``) and
    :meth:`reward` (a pure function of the prompt and the completion text).

    ``chat_template`` says how prompts reach a model (``[task] chat_template``): ``True``
    renders them with the tokenizer's chat template, ``False`` feeds the plain text, ``"auto"``
    renders when the tokenizer has a template (:func:`trainer.tasks.chat.render_prompts`).
    ``reward_spec`` names the reward and its version when the task has one to record
    (``{"name": ..., "version": ...}``); the pipeline writes it into each rollout's metadata.
    """

    name: str = ""
    chat_template: bool | str = "auto"
    reward_spec: dict[str, str] | None = None

    @abc.abstractmethod
    def make_prompts(self, n: int, seed: int) -> list[Prompt]:
        """Return ``n`` prompts; the same ``(n, seed)`` must always give the same prompts."""

    def make_eval_prompts(self, n: int, seed: int) -> list[Prompt]:
        """Held-out prompts for evaluation; tasks without a held-out split draw fresh ones."""
        return self.make_prompts(n, seed)

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion_text: str) -> RewardResult:
        """Score ``completion_text`` as an answer to ``prompt``."""

    def rewards(self, prompts: list[Prompt], completions: list[str]) -> list[RewardResult]:
        """Score a batch pairwise (:func:`score_completion`)."""
        if len(prompts) != len(completions):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(completions)} completions; they must pair up"
            )
        return [score_completion(self, p, c) for p, c in zip(prompts, completions)]


def check_count(n: int) -> None:
    """Validate the ``n`` argument of ``make_prompts``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")


def score_completion(task: Task, prompt: Prompt, completion_text: str) -> RewardResult:
    """``task.reward`` of a completion up to :data:`MAX_SCORED_CHARS` characters; a longer one
    is not read and scores 0.0 as unparseable (``info["error"]`` says why). Generation,
    evaluation and ``rescore`` score through here."""
    if len(completion_text) > MAX_SCORED_CHARS:
        return RewardResult(
            0.0,
            {
                "parsed": None,
                "correct": False,
                "error": f"completion of {len(completion_text)} characters is longer than the "
                f"{MAX_SCORED_CHARS} a reward reads; scored as unparseable",
            },
        )
    return task.reward(prompt, completion_text)
