"""Tasks with verifiable rewards and a name -> task registry.

``get_task("arith")``, ``get_task("countdown", num_numbers=5)`` or
``get_task("file", path="prompts.jsonl", reward="exact")`` return a :class:`Task` whose
``make_prompts(n, seed)`` draws prompts and whose ``reward(prompt, completion_text)`` scores a
completion. Register more with :func:`register_task`.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.tasks.arith import ArithConfig, ArithTask
from trainer.tasks.base import Prompt, RewardResult, Task
from trainer.tasks.countdown import CountdownConfig, CountdownTask
from trainer.tasks.file import REWARD_FUNCTIONS, FileTask

__all__ = [
    "REWARD_FUNCTIONS",
    "ArithConfig",
    "ArithTask",
    "CountdownConfig",
    "CountdownTask",
    "FileTask",
    "Prompt",
    "RewardResult",
    "Task",
    "available_tasks",
    "get_task",
    "register_task",
]

_REGISTRY: dict[str, Callable[..., Task]] = {
    "arith": ArithTask,
    "countdown": CountdownTask,
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


def get_task(name: str, **kwargs: object) -> Task:
    """Build the task registered as ``name``; unknown names raise ValueError listing the options."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {available_tasks()}") from None
    return factory(**kwargs)
