"""The trainer's commands on a store, for ``rolloutstore-train``: ``generate`` (sample scored
rollouts), ``rescore`` (a task's verifier under a new reward version) and ``ingest --from ...
--score-with MODEL`` (other frameworks' text rollouts, log-probs recomputed); and
:func:`task_scorer`, a task as a rolloutstore re-scoring scorer.

    rolloutstore-train generate STORE --model DIR|tiny --task arith [--prompts 256 ...]
    rolloutstore-train rescore STORE --task NAME [--task-option K=V] [--where EXPR --param V]
    rolloutstore-train ingest STORE FILE --from verl|trl|openai --score-with MODEL_DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

from rolloutstore.errors import RescoreError, UsageError
from rolloutstore.retention.rescore import Scorer
from trainer.rollout.pipeline import TINY_MODEL, RoundIds, generate_rollouts

ADVANTAGE_MODES = ("grpo", "drgrpo")


# -- commands ------------------------------------------------------------------------------------
def register_commands(subparsers: Any) -> None:
    """Add ``generate``, ``rescore`` and ``ingest`` to ``rolloutstore-train``."""
    from rolloutstore.cli.ingest import add_ingest_parser

    add_generate_parser(subparsers)
    add_rescore_parser(subparsers)
    from rolloutstore.options import add_dataclass_args
    from trainer.rollout.scoring import ScoringConfig

    group = add_ingest_parser(subparsers, transformer=row_transformer)
    add_dataclass_args(group, ScoringConfig, flags={"batch_tokens": "--score-batch-tokens"})


def add_rescore_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "rescore", help="re-score stored rollouts under a new reward_version (tokens untouched)"
    )
    p.add_argument("store")
    p.add_argument("--task", required=True, help="task whose verifier scores (arith, ...)")
    p.add_argument("--task-option", action="append", default=[], metavar="K=V", help="task option")
    p.add_argument(
        "--from-task", default=None, help="rows' task column to re-score (default: --task)"
    )
    p.add_argument(
        "--where",
        default=None,
        help="filter over rollouts_scored picking groups, e.g. 'reward > ?'",
    )
    p.add_argument("--param", action="append", default=[], help="value for the next ? in --where")
    p.add_argument("--advantage-mode", choices=ADVANTAGE_MODES, default="grpo")
    p.add_argument("--note", default=None, help="free-form note stored with the new version")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_rescore)
    return p


def cmd_rescore(a: argparse.Namespace) -> None:
    from rolloutstore.cli.base import open_store
    from rolloutstore.options import parse_scalar

    options = {}
    for opt in a.task_option:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise RescoreError(f"--task-option takes KEY=VALUE, got {opt!r}")
        options[key.replace("-", "_")] = parse_scalar(value)
    r = open_store(a.store).rescore(  # a run folder names its store
        task_scorer(a.task, options, a.advantage_mode),
        where=a.where,
        params=[parse_scalar(p) for p in a.param],
        from_task=a.from_task,
        note=a.note,
        progress=not a.quiet,
    )
    print(r.line())


# -- scorers -------------------------------------------------------------------------------------
def task_scorer(task: Any, options: dict[str, Any] | None = None, mode: str = "grpo") -> Scorer:
    """A task (its name, with ``options``, or a ``trainer.tasks.Task``) as a rolloutstore
    :class:`~rolloutstore.retention.rescore.Scorer`: its verifier scores a row, its group
    advantages (``mode``: grpo or drgrpo) follow."""
    from trainer.algo.advantage import group_advantages
    from trainer.tasks import get_task

    options = dict(options or {})
    label = task if isinstance(task, str) else ""
    if isinstance(task, str):
        try:
            task = get_task(task, **options)
        except (ValueError, TypeError) as exc:
            raise RescoreError(f"--task {label!r} with options {options}: {exc}") from exc
    elif not callable(getattr(task, "reward", None)):
        raise RescoreError(f"cannot score with {task!r}: expected a task name or a Task")
    elif options:
        raise RescoreError("task options only apply when the task is given by name")
    if mode not in ADVANTAGE_MODES:
        raise RescoreError(f"advantage_mode must be grpo or drgrpo, got {mode!r}")
    return Scorer(
        score=functools.partial(_task_score, task),
        name=getattr(task, "name", "") or label,
        advantage_fn=functools.partial(_advantages, group_advantages, mode),
        spec={"options": options, "advantage_mode": mode},
    )


def row_transformer(options: Any, args: argparse.Namespace | None = None):
    """The tokenizer + teacher-forced scorer of ``ingest --from`` (text rows to token rows),
    with the ``--score-*`` flags of ``args``."""
    from rolloutstore.options import dataclass_from_args
    from trainer.rollout.scoring import ScoringConfig
    from trainer.rollout.text_import import TextRowTransformer

    try:
        scoring = dataclass_from_args(ScoringConfig, args or argparse.Namespace())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return TextRowTransformer(options, scoring)


def _advantages(fn, mode: str, rewards, group_ids):
    return fn(rewards, group_ids, mode=mode)


def _task_score(task, row: dict[str, Any]):
    from trainer.tasks import score_completion

    return score_completion(task, _prompt(row), row["completion_text"] or "")


def _prompt(row: dict[str, Any]):
    from trainer.tasks import Prompt

    rid = row["rollout_id"]
    if row["prompt_text"] is None:
        raise RescoreError(f"rollout {rid}: prompt_text is null; rescore needs the prompt text")
    try:
        meta = json.loads(row["metadata"]) if row["metadata"] else {}
    except json.JSONDecodeError as exc:
        raise RescoreError(f"rollout {rid}: metadata is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("answer"), str):
        raise RescoreError(
            f"rollout {rid}: metadata has no 'answer' string; rescore needs the reference "
            'answer as trainer.rollout.pipeline writes it: {"answer": ..., "prompt_meta": {...}}'
        )
    return Prompt(row["prompt_text"], meta["answer"], dict(meta.get("prompt_meta") or {}))


def resolve_model(model: str, store_path: str | Path, task: str) -> Path:
    """``model`` as a folder; ``"tiny"`` means ``STORE/../tiny-model``, built for ``task`` if absent."""
    if model != TINY_MODEL:
        from trainer.models.load import check_model_dir

        return check_model_dir(model, "--model")
    path = Path(store_path).resolve().parent / "tiny-model"
    if not (path / "config.json").is_file():
        from trainer.models.tiny import make_tiny_model

        print(f"building a tiny {task} model into {path}")
        make_tiny_model(path, task=task, seed=0)
    return path


def cmd_generate(args: argparse.Namespace) -> None:
    """Run ``rolloutstore-train generate`` from parsed arguments and print the closing summary line."""
    from rolloutstore import RolloutStore

    task_cfg, task, gen = generate_config(args)  # every check before anything is written
    ids = RoundIds(args.run_id, policy_id=args.policy_id, seed=args.seed)
    model = resolve_model(args.model, args.store, task_cfg.name)  # before the store is made
    store = RolloutStore.open(args.store, create=True)
    summary = generate_rollouts(
        store, model, task, args.prompts, generation=gen, policy_version=args.policy_version,
        ids=ids, progress=not args.quiet,
    )  # fmt: skip
    print(summary.line())


# What ``generate`` takes from the run config: [task] name (as --task) and tools, and every
# [generation] key but prompts_per_round (a run's round size; generate has --prompts) and
# engine_log (a run's RUN_DIR/engine.log; generate prints the engine's output as vLLM does).
GENERATE_TASK_KEYS = ("name", "tools")
GENERATE_SKIPS = ("prompts_per_round", "engine_log")


def generate_config(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``generate``'s ``(TaskConfig, its task, GenerationConfig)`` from its options (the others
    keep the run config's defaults), validated by the config's own rules; a bad value is a
    :class:`UsageError` naming the option."""
    from rolloutstore.options import dataclass_from_args
    from trainer.config import TaskConfig, check_turns
    from trainer.rollout.sampling import GenerationConfig

    try:
        task = dataclass_from_args(TaskConfig, args)
        gen = dataclass_from_args(GenerationConfig, args)
        check_turns(task, gen)
        built = task.build()
    except (ValueError, TypeError) as exc:
        raise UsageError(_as_options(str(exc))) from exc
    return task, built, gen


def _as_options(message: str) -> str:
    """A config error in ``generate``'s words: ``[generation].max_turns`` -> ``--max-turns``."""
    from trainer.rollout.sampling import GenerationConfig

    names = {f.name for f in dataclasses.fields(GenerationConfig)} - set(GENERATE_SKIPS)
    flags = {("task", "tools"): "--tools", ("task", "name"): "--task"}
    flags.update({("generation", n): "--" + n.replace("_", "-") for n in names})

    def flag(m: re.Match) -> str:
        return flags.get((m[1], m[2]), m[0])

    message = re.sub(r"\[(\w+)\]\.(\w+)", flag, message)
    first = message.split(" ", 1)[0]
    if first in names:  # the sampling checks name the bare field
        message = "--" + first.replace("_", "-") + message[len(first) :]
    return message


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``generate`` on an ``add_subparsers()`` object; ``args.func(args)`` runs it.

    Its sampling and generation options are the run config's ``[generation]`` keys (and
    ``[task]`` name and tools), built from the same dataclasses with the same defaults."""
    from rolloutstore.options import add_dataclass_args
    from trainer.config import TaskConfig
    from trainer.rollout.sampling import GenerationConfig

    p = subparsers.add_parser(
        "generate", help="sample scored rollouts from a model into a store (vLLM or transformers)"
    )
    p.add_argument("store")
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint folder, or 'tiny' (built into STORE/../tiny-model)",
    )
    add_dataclass_args(
        p, TaskConfig, only=GENERATE_TASK_KEYS, flags={"name": "--task"}, metavars={"tools": "TOOL"}
    )
    p.add_argument("--prompts", type=int, default=256, help="prompts to draw (default: 256)")
    add_dataclass_args(p, GenerationConfig, skip=GENERATE_SKIPS)
    p.add_argument("--policy-version", type=int, default=0)
    p.add_argument("--policy-id", default=None)
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling (batch b: seed + b)")
    p.add_argument("--run-id", default="default")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)
    return p
