"""The run config's own sections: ``[model]``, ``[task]`` and ``[run]`` (frozen dataclasses
with defaults and help), and what resolves from them (``process_threads``, ``check_turns``).

The other sections belong to the modules that use them (``[generation]``:
trainer.rollout.sampling, ``[replay]``: rolloutstore, ``[loss]`` / ``[optim]``: trainer.algo,
``[eval]``: trainer.rollout.evaluation); :mod:`trainer.config` assembles, loads and validates
them all and re-exports these names.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import Literal

from rolloutstore.options import help_field as _h
from trainer.errors import ConfigError, TaskFileError
from trainer.models.cores import cpu_count
from trainer.models.lora import LoraSettings
from trainer.rollout.ray_config import RayConfig
from trainer.rollout.sampling import GenerationConfig
from trainer.tasks import Task, get_task
from trainer.tasks.chat import check_chat_mode
from trainer.tasks.tools import check_tool_names, with_tools

Mode = Literal["sync", "async"]
Launcher = Literal["local", "ray"]
IdMode = Literal["seeded", "clock"]


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]


@dataclass(frozen=True)
class ModelConfig:
    path: str = _h('"tiny" to build a tiny Qwen2 model for the task, or a model folder', "tiny")
    hidden_size: int = _h("tiny model: hidden size (head_dim 64 for vLLM on CPU)", 128)
    num_layers: int = _h("tiny model: layers", 2)
    vocab_size: int = _h("tiny model: tokenizer vocabulary", 512)
    seed: int | None = _h("tiny model: init seed (None: [run].seed)", None)
    dtype: Dtype = _h(
        "precision the model runs in: auto (bfloat16 on CUDA, float32 on CPU), float32, "
        "bfloat16, float16 (CUDA only); the learner keeps float32 weights and runs under "
        "autocast, its LM head and softmax always in float32",
        "auto",
    )
    device: str = _h(
        "single-process learner and transformers generator: auto (CUDA when available), cpu, "
        "cuda, cuda:N (torchrun ranks use cuda:LOCAL_RANK)",
        "auto",
    )
    attn_implementation: AttnImplementation = _h(
        "transformers attention: sdpa, eager, flash_attention_2 (needs flash-attn and CUDA)",
        "sdpa",
    )
    gradient_checkpointing: bool = _h(
        "learner: recompute activations in backward (less memory, ~30% slower learner steps)",
        False,
    )
    trust_remote_code: bool = _h(
        "run the model folder's own Python code (only for folders you trust)", False
    )
    lora: LoraSettings | None = _h(
        "[model.lora]: train LoRA adapters (peft) instead of every weight; generators get the "
        "merged weights (trainer/models/lora.py)",
        None,
    )

    def __post_init__(self) -> None:
        if self.lora is not None:
            object.__setattr__(self, "lora", LoraSettings.from_table(self.lora))
        if self.hidden_size % 64:
            raise ValueError(f"hidden_size must be a multiple of 64, got {self.hidden_size}")
        for key, kind in (("dtype", Dtype), ("attn_implementation", AttnImplementation)):
            if getattr(self, key) not in typing.get_args(kind):
                raise ConfigError(
                    f"[model].{key} = {getattr(self, key)!r}: choose one of "
                    f"{', '.join(typing.get_args(kind))}"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"[model].seed must be an int, got {self.seed!r}")
        if not _valid_device(self.device):
            raise ConfigError(f"[model].device = {self.device!r}: choose auto, cpu, cuda or cuda:N")
        for key in ("gradient_checkpointing", "trust_remote_code"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"[model].{key} must be true or false, got {getattr(self, key)!r}"
                )


def _valid_device(name: object) -> bool:
    if not isinstance(name, str):
        return False
    if name in ("auto", "cpu", "cuda"):
        return True
    return name.startswith("cuda:") and name[5:].isdigit()


@dataclass(frozen=True)
class TaskConfig:
    name: str = _h("task with a verifiable reward: arith, countdown, dataset (file)", "arith")
    options: dict = _h("the task's own options (e.g. max_digits; dataset: path, reward)", {})
    chat_template: bool | str = _h(
        'render prompts with the tokenizer\'s chat template: true, false, or "auto" (when '
        "the tokenizer has one)",
        "auto",
    )

    # Multi-turn tool use (trainer/tasks/tools.py; [generation].max_turns, max_total_tokens).
    tools: tuple[str, ...] = _h(
        'tools the model may call between turns, e.g. ["calculator"] (multi-turn rollouts)', ()
    )
    tool_demos: float = _h(
        "with tools: share of warm-start demonstrations that call a tool (the rest answer)", 1.0
    )

    def __post_init__(self) -> None:
        check_chat_mode(self.chat_template)
        object.__setattr__(self, "tools", check_tool_names(self.tools))
        d = self.tool_demos
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 1:
            raise ConfigError(f"[task].tool_demos must be a number in [0, 1], got {d!r}")

    def build(self) -> Task:
        """The configured task (its options, chat-template mode and tools); a missing or
        unknown option is a :class:`ConfigError` naming ``[task].options.KEY`` and the fix."""
        try:
            task = get_task(self.name, chat_template=self.chat_template, **self.options)
        except TypeError as exc:
            raise ConfigError(_task_option_error(self.name, str(exc))) from exc
        except TaskFileError as exc:  # the file an option names (path, eval_path) is not there
            raise TaskFileError(
                f"[task].options: {exc}; fix the path (relative paths start at the current folder)"
            ) from exc
        return with_tools(task, self.tools, demo_tool_fraction=float(self.tool_demos))


def _task_option_error(name: str, message: str) -> str:
    """A task constructor's TypeError (a missing or unexpected keyword) in config words."""
    import re

    missing = re.search(
        r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)", message
    )
    if missing:
        keys = re.findall(r"'(\w+)'", missing[1])
        example = ", ".join(f'{k} = "..."' for k in keys)
        return (
            f"[task].options.{keys[0]} is required by the {name!r} task: add it, e.g. "
            f"options = {{ {example} }}"
        )
    unknown = re.search(r"unexpected keyword argument '(\w+)'", message)
    if unknown:
        hint = (
            '; [task].name defaults to "arith": for a file of prompts set [task].name = "dataset"'
            if unknown[1] == "path" and name != "dataset"
            else ""
        )
        return (
            f"[task].options.{unknown[1]}: the {name!r} task has no such option; remove it or "
            f"fix its name{hint}"
        )
    return f"[task].options of the {name!r} task: {message}"


def check_turns(task: TaskConfig, generation: GenerationConfig) -> None:
    """Tools and turns go together: a tool result needs a model turn after it, and more than
    one turn needs something to answer between turns."""
    if task.tools and generation.max_turns < 2:
        raise ConfigError(
            f"[generation].max_turns = {generation.max_turns} with [task].tools leaves no turn "
            "after a tool result: set it >= 2"
        )
    if not task.tools and generation.max_turns > 1:
        raise ConfigError(
            f"[generation].max_turns = {generation.max_turns} needs [task].tools (nothing "
            "answers the model between turns): add a tool or set it to 1"
        )


@dataclass(frozen=True)
class RunConfig:
    dir: str = _h("run folder: store, checkpoints, weights, metrics", "runs/arith")
    run_id: str = _h("run id recorded with rollouts (default: the folder name)", "")
    seed: int = _h(
        "seed of generation and evaluation; also [model].seed, [replay].seed and [optim].seed "
        "where those are not set",
        0,
    )
    steps: int = _h(
        "learner steps (drawn batches) in total; also [optim].total_steps unless set", 40
    )
    updates_per_round: int = _h("learner steps per generation round (sets the replay ratio)", 2)
    batch_size: int = _h("rollouts per learner step", 64)
    max_tokens_per_batch: int = _h(
        "also cap each learner step at this many tokens (0: no cap; long-context runs)", 0
    )
    pack: bool = _h("pack sequences into one row with cu_seqlens (no padding)", False)
    checkpoint_every: int = _h("learner steps between checkpoints", 10)
    keep_checkpoints: int = _h("checkpoints kept", 3)
    keep_weight_versions: int = _h(
        "published policy versions kept under the weights location (0: all); the versions the "
        "kept checkpoints hold and the newest are never removed",
        3,
    )
    threads: int = _h(
        "CPU threads of each process the run starts (torch in the learner, generators and "
        "actors; the cores a vLLM CPU engine binds); 0: sync, all cores (the learner waits while "
        "vLLM generates); async, the cores split evenly between the learner and its actors",
        0,
    )
    mode: Mode = _h("sync: one process alternates; async: actors and a learner", "sync")
    actors: int = _h("async: actor processes", 1)
    launcher: Launcher = _h(
        'async: what starts and restarts the actors: "local" (processes beside the learner) '
        'or "ray" (Ray actors on a cluster, [run.ray]; pip install rolloutstore[ray])',
        "local",
    )
    ray: RayConfig = _h("[run.ray]: the Ray launcher's cluster and actor resources", RayConfig())
    min_rows: int = _h("async: the learner waits until the buffer holds this many rows", 64)
    warm_start_steps: int = _h("supervised steps on task solutions before RL", 0)
    warm_start_lr: float = _h("learning rate of the warm start", 1e-3)
    ids: IdMode = _h(
        'rollout ids: "seeded" (functions of the seed, the config and the position, not of '
        'the folder or the clock: twin runs write the same rows) or "clock" (the run id and '
        "start time, so UUIDv7 ids sort by run across runs)",
        "seeded",
    )
    id_time_ms: int = _h(
        'time field of rollout ids, ms since epoch (0: seeded ids: 0; "clock": the run\'s start)',
        0,
    )
    store: str = _h(
        "rollout store URI, e.g. s3://bucket/run/store (empty: $ROLLOUTSTORE_STORE_URI, "
        "else RUN_DIR/store; async mode and actors)",
        "",
    )
    weights: str = _h(
        "published weights location, e.g. s3://bucket/run/weights (empty: "
        "$ROLLOUTSTORE_WEIGHTS_URI, else RUN_DIR/weights; async mode and actors)",
        "",
    )
    sources: tuple[str, ...] = _h("earlier run (or store) folders whose rollouts are replayed", ())
    max_generated_tokens: int = _h(
        "sync: stop at the first round boundary with this many tokens generated (0: off)", 0
    )
    fsdp: bool = _h(
        "under torchrun: shard the learner with FSDP2 (fully_shard per decoder layer) instead "
        "of DDP replicas; an error without torchrun",
        False,
    )

    def __post_init__(self) -> None:
        if self.mode not in typing.get_args(Mode):
            raise ValueError(f"mode must be one of {typing.get_args(Mode)}, got {self.mode!r}")
        if self.launcher not in typing.get_args(Launcher):
            raise ConfigError(f'[run].launcher = {self.launcher!r}: choose "local" or "ray"')
        try:
            object.__setattr__(self, "ray", RayConfig.from_table(self.ray))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[run.ray]: {exc}") from exc
        if self.ids not in typing.get_args(IdMode):
            raise ConfigError(f'[run].ids = {self.ids!r}: choose "seeded" or "clock"')
        for name in ("steps", "updates_per_round", "batch_size", "checkpoint_every", "actors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "keep_checkpoints", "min_rows", "warm_start_steps", "max_tokens_per_batch",
            "keep_weight_versions", "threads",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def process_threads(run: RunConfig) -> int:
    """``[run] threads`` resolved for one process of the run: the setting, else all cores in
    sync mode and an even share (cores // (actors + 1), at least 1) in async mode; under
    torchrun the local ranks split the cores."""
    if run.threads:
        return run.threads
    cores = cpu_count() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if run.mode == "async":
        return max(1, cores // (run.actors + 1))
    return max(1, cores)
