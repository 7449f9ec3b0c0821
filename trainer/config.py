"""The run configuration: one TOML file, one frozen dataclass per section.

    [model]       path = "tiny" (build one) or a model folder
    [model.lora]  LoRA adapters through peft (trainer.models.lora.LoraSettings; off when absent)
    [task]        name = "arith", plus the task's own options under [task.options]
    [generation]  backend, group size, sampling, prompts per round
    [replay]      rolloutstore.ReplayConfig
    [replay.control]  trainer.control.ControlConfig (replay-ratio controller, off by default)
    [loss]        trainer.algo.loss.LossConfig
    [optim]       trainer.algo.optim.OptimConfig
    [run]         dir, seed, steps, updates per round, batch size, checkpoints, mode, launcher
    [run.ray]     trainer.rollout.ray_config.RayConfig (launcher = "ray": cluster, actor resources)
    [eval]        held-out evaluation: prompts, samples per prompt or greedy, temperature, every
    [store]       how the run's store keeps rollouts: logprob_precision (0: lossless)

Unknown sections or keys and bad values fail before any work starts, naming
``[section].key``. The seeds of [model], [replay] and [optim] and ``[optim].total_steps``
follow ``[run]`` (seed, steps) where a config leaves them unset (FOLLOW_RUN); a run.json holds
the values they took.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rolloutstore.options import help_field as _h
from rolloutstore.replay.config import ReplayConfig
from rolloutstore.store.precision import check_bound
from trainer.algo.loss import LossConfig
from trainer.algo.optim import OptimConfig
from trainer.config_sections import (  # noqa: F401 (re-exported: trainer.config is the API)
    AttnImplementation,
    Dtype,
    IdMode,
    Mode,
    ModelConfig,
    RunConfig,
    TaskConfig,
    check_turns,
    cpu_count,
    process_threads,
)
from trainer.control import ControlConfig
from trainer.errors import ConfigError, TaskFileError  # noqa: F401 (re-exported)
from trainer.models.lora import LoraSettings
from trainer.rollout.evaluation import EvalConfig
from trainer.rollout.ray_config import RayConfig
from trainer.rollout.sampling import GenerationConfig


@dataclass(frozen=True)
class StoreConfig:
    logprob_precision: float = _h(
        "absolute error bound (nats) of the stored behaviour log-probs: 0 keeps them lossless "
        "(float32); e.g. 1e-3 rounds them to a power-of-two grid within it (about 2.5 bytes "
        "per token fewer; docs/benchmarks.md). Recorded in the store; it may be raised, never "
        "lowered; must not exceed [loss].logprob_tolerance",
        0.0,
    )

    def __post_init__(self) -> None:
        try:
            check_bound(self.logprob_precision)
        except ValueError as exc:
            raise ConfigError(f"[store].logprob_precision: {exc}") from exc


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "generation": GenerationConfig,
    "replay": ReplayConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "eval": EvalConfig,
    "store": StoreConfig,
}


# Keys that were renamed: (section, old key) -> new key. Old keys are refused, naming the new.
RENAMED = {("replay.control", "max_staleness"): "max_mean_staleness"}

# Keys that follow [run] unless set: (section, key) -> the [run] key whose value they take.
FOLLOW_RUN = {
    ("model", "seed"): "seed",
    ("replay", "seed"): "seed",
    ("optim", "seed"): "seed",
    ("optim", "total_steps"): "steps",
}

# A second name of a key, still read (with a warning): (section, alias) -> (section, key).
# [optim].grad_checkpointing (run.json files of earlier runs hold it) turns the learner's
# gradient checkpointing on as [model].gradient_checkpointing does.
DEPRECATED = {("optim", "grad_checkpointing"): ("model", "gradient_checkpointing")}

# Keys that moved to another table, still read there (with a FutureWarning; run.json files of
# earlier runs are read silently, see trainer.run.resume): (section, old key) -> (section, key).
MOVED = {("task", "eval_prompts"): ("eval", "prompts"), ("run", "eval_every"): ("eval", "every")}


def move_keys(d: dict[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """``d`` (a config dict) with MOVED keys at their new place (a copy; ``d`` is not changed).
    An old key beside its new one with another value is a :class:`ConfigError`."""
    d = {name: dict(v) if isinstance(v, dict) else v for name, v in d.items()}
    for (section, old), (target, key) in MOVED.items():
        table = d.get(section)
        if not isinstance(table, dict) or old not in table:
            continue
        value = table.pop(old)
        dest = d.setdefault(target, {})
        if not isinstance(dest, dict):
            continue  # "[eval] must be a table" is said when it is built
        if key in dest and dest[key] != value:
            raise ConfigError(
                f"[{section}].{old} = {value!r} and [{target}].{key} = {dest[key]!r}: the old "
                f"key moved to [{target}].{key}; remove [{section}].{old}"
            )
        if warn:
            warnings.warn(
                f"[{section}].{old} moved to [{target}].{key}: set that instead (read as it)",
                FutureWarning,
                stacklevel=3,
            )
        dest[key] = value
    return d


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table, got {type(values).__name__}")
    for key in values:
        if (section, key) in RENAMED:
            raise ConfigError(
                f"[{section}].{key} was renamed {RENAMED[section, key]!r} (the mean staleness "
                f"of a batch; [replay].max_staleness bounds each row): rename the key"
            )
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise ConfigError(
                f"[{section}].{key}: unknown key; known keys: {', '.join(sorted(names))}"
            )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if isinstance(value, list) and "tuple" in str(hints[key]):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise  # already names [section].key
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"[{section}]: {exc}") from exc


def _read_deprecated(d: dict[str, Any]) -> None:
    """Move DEPRECATED keys of ``d`` to the keys they name (in place); a true one warns."""
    for (section, alias), (target, key) in DEPRECATED.items():
        table = d.get(section)
        if not isinstance(table, dict) or alias not in table:
            continue
        value = table.pop(alias)
        if not isinstance(value, bool):
            raise ConfigError(
                f"[{section}].{alias} (now [{target}].{key}) must be true or false, got {value!r}"
            )
        if value:
            warnings.warn(
                f"[{section}].{alias} is deprecated: set [{target}].{key} = true instead "
                "(read as that)",
                FutureWarning,
                stacklevel=3,
            )
            dest = d.setdefault(target, {})
            if isinstance(dest, dict):
                dest[key] = True


def _split_sub(values: Any, section: str, sub: str) -> tuple[Any, dict[str, Any] | None]:
    """``[section]`` minus its ``sub`` subtable (also ``sub.key`` as from ``--set``); the
    subtable is None when neither appears (or it is given as null, e.g. in a run.json)."""
    if not isinstance(values, dict):
        return values, None
    rest: dict[str, Any] = {}
    table: dict[str, Any] | None = None
    for key, value in values.items():
        if key == sub:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"[{section}.{sub}] must be a table, got {type(value).__name__}")
            table = {**(table or {}), **value}
        elif key.startswith(f"{sub}."):
            table = {**(table or {}), key.removeprefix(f"{sub}."): value}
        else:
            rest[key] = value
    return rest, table


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        if self.store.logprob_precision > self.loss.logprob_tolerance:
            raise ConfigError(
                f"[store].logprob_precision = {self.store.logprob_precision:g} nats is more than "
                f"the loss tolerates ([loss].logprob_tolerance = {self.loss.logprob_tolerance:g}):"
                " lower the first or raise the second"
            )
        for (section, key), source in FOLLOW_RUN.items():
            table = getattr(self, section)
            if getattr(table, key) is None:
                value = getattr(self.run, source)
                object.__setattr__(self, section, dataclasses.replace(table, **{key: value}))
        if self.generation.dtype == "auto" and self.model.dtype != "auto":
            # [generation].dtype defaults to the learner's: the generators sample from the
            # distribution the learner scores.
            gen = dataclasses.replace(self.generation, dtype=self.model.dtype)
            object.__setattr__(self, "generation", gen)
        if self.model.lora is not None and self.run.fsdp:
            raise ConfigError(
                "[model.lora] with [run].fsdp = true is not supported (the adapters are small: "
                "train them with DDP replicas); set [run].fsdp = false or remove [model.lora]"
            )
        check_turns(self.task, self.generation)
        if self.eval.greedy and self.task.tools:
            raise ConfigError(
                "[eval].greedy with [task].tools: multi-turn evals sample each turn; set "
                "[eval].greedy = false (samples_per_prompt and temperature as wanted)"
            )
        if self.control.enabled and self.run.mode != "sync":
            raise ConfigError(
                "[replay.control].enabled: the replay-ratio controller drives the sync loop "
                f'only; set [run].mode = "sync" or disable it (mode is {self.run.mode!r})'
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        for section in d:
            if section not in SECTIONS:
                raise ConfigError(
                    f"[{section}]: unknown section; known sections: {', '.join(SECTIONS)}"
                )
        d = move_keys(d)  # [task].eval_prompts, [run].eval_every: now [eval]'s
        replay, control = _split_sub(d.get("replay", {}), "replay", "control")
        d["replay"] = replay
        model, lora = _split_sub(d.get("model", {}), "model", "lora")
        if lora is not None:
            model = {**model, "lora": lora}
        d["model"] = model
        run_table, ray_table = _split_sub(d.get("run", {}), "run", "ray")
        if ray_table is not None:
            run_table = {**run_table, "ray": ray_table}
        d["run"] = run_table
        _read_deprecated(d)
        run = _build("run", RunConfig, d.get("run", {}))
        for (section, key), source in FOLLOW_RUN.items():
            table = d.setdefault(section, {})
            if isinstance(table, dict) and table.get(key) is None:
                table[key] = getattr(run, source)  # before building: cosine needs total_steps
        return cls(
            **{
                name: run if name == "run" else _build(name, kind, d.get(name, {}))
                for name, kind in SECTIONS.items()
            },
            control=_build("replay.control", ControlConfig, control or {}),
        )

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in SECTIONS:
            d = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        out["replay"]["control"] = dataclasses.asdict(self.control)
        return out

    def with_run(self, **changes: Any) -> TrainConfig:
        """This config with ``[run]`` changed; keys that follow [run] (FOLLOW_RUN: those equal
        to the [run] value they follow) follow the new value."""
        run = dataclasses.replace(self.run, **changes)
        tables: dict[str, Any] = {}
        for (section, key), source in FOLLOW_RUN.items():
            table = tables.get(section, getattr(self, section))
            if getattr(table, key) == getattr(self.run, source) != getattr(run, source):
                tables[section] = dataclasses.replace(table, **{key: getattr(run, source)})
        return dataclasses.replace(self, run=run, **tables)

    @property
    def run_id(self) -> str:
        return self.run.run_id or Path(self.run.dir).name


# Scale-out (docs/scaling.md): the store and the weights on an object store, read by the
# learner and by every actor; storage options (Lance keys) as a JSON object. The config's
# [run] store / weights win over the variables; credentials stay in the environment.
STORE_ENV = "ROLLOUTSTORE_STORE_URI"
WEIGHTS_ENV = "ROLLOUTSTORE_WEIGHTS_URI"
OPTIONS_ENV = "ROLLOUTSTORE_STORAGE_OPTIONS"


def storage_options_from_env() -> dict[str, str] | None:
    """Storage options from $ROLLOUTSTORE_STORAGE_OPTIONS (a JSON object of strings), or None."""
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return None
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f'${OPTIONS_ENV} is not JSON ({exc}); e.g. \'{{"aws_region": "us-east-1"}}\''
        ) from exc
    if not isinstance(opts, dict) or not all(isinstance(v, str) for v in opts.values()):
        raise ConfigError(f"${OPTIONS_ENV} must be a JSON object of string values, got {raw!r}")
    return opts


def configured_location(cfg: TrainConfig, what: Literal["store", "weights"]) -> str | None:
    """``[run] store`` / ``weights``, else $ROLLOUTSTORE_STORE_URI / _WEIGHTS_URI, else None."""
    env = STORE_ENV if what == "store" else WEIGHTS_ENV
    return getattr(cfg.run, what) or os.environ.get(env) or None


# -- `rolloutstore-train config --defaults` ---------------------------------------------------------
# Every table a run config may hold, in the order a config file reads; subtables after their parent.
TABLES: dict[str, type] = {
    "model": ModelConfig,
    "model.lora": LoraSettings,
    "task": TaskConfig,
    "generation": GenerationConfig,
    "replay": ReplayConfig,
    "replay.control": ControlConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "run.ray": RayConfig,
    "eval": EvalConfig,
    "store": StoreConfig,
}
# Subtables that are off unless present: their keys are printed commented out.
OFF_UNLESS_PRESENT = {"model.lora"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {v!r}")


def defaults_toml() -> str:
    """Every key of every table with its default and help, as a TOML file that loads to the
    default config: each key's help as a comment above it; keys whose default is unset
    (None: off, or following [run]) and the keys of off-by-default subtables commented out."""
    from rolloutstore.options import field_default

    lines = [
        "# rolloutstore-train: every config key with its default (rolloutstore-train config "
        "--defaults).",
        "# Unset keys and off-by-default tables are commented out; uncomment to set them.",
    ]
    for table, cls in TABLES.items():
        off = table in OFF_UNLESS_PRESENT
        lines += ["", f"# [{table}]" if off else f"[{table}]"]
        if cls.__doc__ and off:
            lines.append(f"# {cls.__doc__.strip().splitlines()[0]}")
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(_field_type(cls, f.name)):  # a subtable: its own header
                continue
            default = field_default(f)
            for text in _wrap(str(f.metadata.get("help", "")).strip()):
                lines.append(f"# {text}")
            if default is None:
                lines.append(f"# {f.name} = (unset)")
            else:
                lines.append(f"{'# ' if off else ''}{f.name} = {_toml_value(default)}")
    return "\n".join(lines) + "\n"


def _field_type(cls: type, name: str) -> Any:
    tp = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


def _wrap(text: str, width: int = 98) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]
