"""LoRA through peft: the ``[model.lora]`` settings, the learner's adapters, and merged weights.

With ``[model.lora]`` set, the learner's model gets peft LoRA adapters on ``target_modules``
(:func:`apply_lora`): the base weights are frozen, so the optimizer holds only the adapters'
``lora_A`` / ``lora_B`` matrices, and a checkpoint stores only them (:func:`adapter_state`, with
their AdamW moments); a resume loads the base model folder again and the adapters on top.

Generators never see adapters: :func:`generator_state` gives the *merged* weights, ``W + B @ A *
alpha / rank`` for every adapted layer, under the base model's own names (no ``base_layer`` /
``lora_A`` tensors), computed without touching the trained model. That is what the transformers
generator loads and what a vLLM engine receives in place. A published weights folder holds only
the adapters, in PEFT's own format (:func:`save_adapter`: ``adapter_model.safetensors`` +
``adapter_config.json``, so ``peft.PeftModel.from_pretrained(base, folder)`` loads it too);
a reader merges them into the base weights in memory (:func:`merge_adapter`). Needs the ``lora``
extra (``pip install 'rolloutstore[lora]'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rolloutstore.options import help_field as _h
from trainer.errors import ConfigError

# The attention and MLP projections of Qwen2/Qwen3/Llama/Mistral-style decoders.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INSTALL_HINT = "[model.lora] needs the peft package: pip install 'rolloutstore[lora]'"
# peft names every adapter tensor with "lora_" (lora_A, lora_B, lora_embedding_A, ...).
_ADAPTER_MARK = "lora_"
ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's names, so peft loads a published folder
ADAPTER_CONFIG = "adapter_config.json"
# PEFT saves adapter tensors under the PeftModel's names: this prefix, then the module path, and
# without the adapter's name ("...q_proj.lora_A.weight", not "...lora_A.default.weight").
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSettings:
    """``[model.lora]``: rank, scale, dropout and target modules of the adapters."""

    rank: int = _h("adapter rank r", 16)
    alpha: float = _h("scale numerator: each layer adds B @ A * alpha / rank", 32.0)
    dropout: float = _h(
        "dropout on the adapters' input while training (0: the learner's log-probs are "
        "deterministic, so staleness-0 ratios are exactly 1)",
        0.0,
    )
    target_modules: tuple[str, ...] = _h(
        "module names (last name component) that get adapters", LORA_TARGETS
    )

    def __post_init__(self) -> None:
        def bad(key: str, want: str) -> ConfigError:
            return ConfigError(f"[model.lora].{key} must be {want}, got {getattr(self, key)!r}")

        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise bad("rank", "an int >= 1")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not a > 0:
            raise bad("alpha", "a number > 0")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < 1:
            raise bad("dropout", "in [0, 1)")
        t = self.target_modules
        if isinstance(t, str) or not t or not all(isinstance(m, str) and m for m in t):
            raise bad("target_modules", 'a non-empty list of module names, e.g. ["q_proj"]')
        object.__setattr__(self, "alpha", float(a))
        object.__setattr__(self, "dropout", float(d))
        object.__setattr__(self, "target_modules", tuple(t))

    @classmethod
    def from_table(cls, table: Any) -> LoraSettings:
        """``[model.lora]`` as read from TOML (a table); ConfigError names the bad key."""
        if isinstance(table, LoraSettings):
            return table
        if not isinstance(table, Mapping):
            raise ConfigError(f"[model.lora] must be a table, got {type(table).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in table:
            if key not in names:
                raise ConfigError(
                    f"[model.lora].{key}: unknown key; known keys: {', '.join(sorted(names))}"
                )
        values = dict(table)
        if isinstance(values.get("target_modules"), list):
            values["target_modules"] = tuple(values["target_modules"])
        return cls(**values)


def require_peft() -> Any:
    """The peft module, or ConfigError with the install line when it is missing."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT} ({exc})") from exc
    return peft


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, seed: int) -> torch.nn.Module:
    """``model`` with peft LoRA adapters injected (the same object; base weights frozen).

    The adapters' ``lora_A`` start from a seeded draw (``seed``; the caller's RNG is left as
    it was) and ``lora_B`` at zero, so the merged weights start equal to the base weights.
    """
    peft = require_peft()
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    devices = [model.device] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config)
        except ValueError as exc:  # none of the target modules exist in this model
            raise ConfigError(
                f"[model.lora].target_modules = {list(settings.target_modules)} match no module "
                f"of this model ({' '.join(str(exc).split())[:200]}); name its linear layers, "
                f"e.g. {list(LORA_TARGETS)}"
            ) from exc
    # The decoder itself, adapters inside: the learner needs model.model and model.lm_head.
    return wrapped.get_base_model()


def has_lora(model_or_state: torch.nn.Module | Mapping[str, Any]) -> bool:
    """Whether a model (or state dict) carries LoRA adapter tensors."""
    if isinstance(model_or_state, Mapping):
        keys = model_or_state.keys()
    else:
        keys = (name for name, _ in model_or_state.named_parameters())
    return any(_ADAPTER_MARK in k for k in keys)


def is_adapter_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` holds adapter tensors only (an adapter-only checkpoint)."""
    return bool(state) and all(_ADAPTER_MARK in k for k in state)


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA model's state dict (what a checkpoint stores)."""
    return {k: v for k, v in state.items() if _ADAPTER_MARK in k}


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta merged in, under the base names.

    Adapted layers get new tensors ``W + delta`` (peft's ``get_delta_weight``: ``B @ A *
    scaling``); the other entries are the model's own tensors, as ``state_dict()`` gives them.
    The model is not changed.
    """
    from peft.tuners.lora import LoraLayer

    out = {
        k.replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if _ADAPTER_MARK not in k
    }
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.merged:
            continue
        key = f"{name}.weight"
        weight = out[key]
        delta = torch.zeros_like(weight)
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                delta = delta + module.get_delta_weight(adapter).to(weight.dtype)
        out[key] = weight + delta
    return out


def generator_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a generator loads: :func:`merged_state` with adapters, else ``state_dict()``."""
    return merged_state(model) if has_lora(model) else model.state_dict()


def save_adapter(
    folder: Path, model: torch.nn.Module, base: str, dtype: torch.dtype | None = None
) -> None:
    """Write ``model``'s adapters into ``folder`` in PEFT's format, tensors in ``dtype`` (None:
    as they are); ``base`` (the base model folder) is recorded as ``base_model_name_or_path``."""
    peft = require_peft()
    config = model.peft_config["default"]  # type: ignore[index]
    state = peft.get_peft_model_state_dict(model)
    tensors = {
        _PEFT_PREFIX + k: (v.to(dtype) if dtype is not None else v).detach().contiguous().clone()
        for k, v in state.items()
    }
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    copy = dataclasses.replace(config, base_model_name_or_path=base, inference_mode=True)
    copy.save_pretrained(str(folder))


@torch.no_grad()
def merge_adapter(base: Mapping[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """``base`` (a base model's state dict) with the adapters of a :func:`save_adapter` folder
    merged in: ``W + B @ A * scaling`` per adapted layer (the order of peft's
    ``get_delta_weight``, so the result equals :func:`merged_state` of the learner bit for bit
    in float32), in each base tensor's dtype. ValueError when the adapters do not fit ``base``."""
    peft = require_peft()
    config = peft.LoraConfig.from_pretrained(str(folder))
    if config.use_dora or config.fan_in_fan_out or config.rank_pattern or config.alpha_pattern:
        raise ValueError(f"{folder}: only plain LoRA adapters are merged here ({ADAPTER_CONFIG})")
    scaling = config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)
    tensors = load_file(str(folder / ADAPTER_FILE))
    out = dict(base)
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(f"{_PEFT_PREFIX}{module}.lora_B.weight")
        weight = base.get(f"{module}.weight")
        if b is None or weight is None:
            raise ValueError(f"{folder}: adapter {module!r} does not fit the base model")
        delta = (b.float() @ a.float()) * scaling
        out[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return out
