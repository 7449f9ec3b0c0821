"""Tasks with verifiable rewards and a name -> task registry.

``get_task("arith")``, ``get_task("countdown", num_numbers=5)`` or
``get_task("dataset", path="math.jsonl", reward="math")`` (``file`` is the same task under
its original name) return a :class:`Task` whose ``make_prompts(n, seed)`` draws prompts and
whose ``reward(prompt, completion_text)`` scores a completion (the loops score through
:func:`score_completion`, which reads at most :data:`MAX_SCORED_CHARS` characters). ``chat_template`` (``True``,
``False`` or ``"auto"``) says how its prompts reach a model (trainer/tasks/chat.py). Register
more with :func:`register_task`.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.tasks.arith import ArithConfig, ArithTask
from trainer.tasks.base import MAX_SCORED_CHARS, Prompt, RewardResult, Task, score_completion
from trainer.tasks.chat import check_chat_mode
from trainer.tasks.countdown import CountdownConfig, CountdownTask
from trainer.tasks.dataset import DatasetTask, FileTask
from trainer.tasks.rewards import BUILTIN_REWARDS, Reward, get_reward

__all__ = [
    "BUILTIN_REWARDS",
    "MAX_SCORED_CHARS",
    "ArithConfig",
    "ArithTask",
    "CountdownConfig",
    "CountdownTask",
    "DatasetTask",
    "FileTask",
    "Prompt",
    "Reward",
    "RewardResult",
    "Task",
    "available_tasks",
    "get_reward",
    "get_task",
    "register_task",
    "score_completion",
]

_REGISTRY: dict[str, Callable[..., Task]] = {
    "arith": ArithTask,
    "countdown": CountdownTask,
    "dataset": DatasetTask,
    "file": FileTask,
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make ``get_task(name, **kwargs)`` call ``factory(**kwargs)``; names may not be reused."""
    if not name or not isinstance(name, str):
        raise ValueError(f"task name must be a non-empty str, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"task {name!r} is already registered")
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_REGISTRY)


def get_task(name: str, *, chat_template: bool | str = "auto", **kwargs: object) -> Task:
    """Build the task registered as ``name`` with its ``chat_template`` mode; unknown names
    raise ValueError listing the options."""
    check_chat_mode(chat_template)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {available_tasks()}") from None
    task = factory(**kwargs)
    task.chat_template = chat_template
    return task
