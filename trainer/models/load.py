"""Loading a model folder, and the ``[model]`` device / dtype rules every loader shares.

Precision: ``[model].dtype`` is the precision the model *runs* in. The learner keeps its weights
(and AdamW moments) in float32 and runs the transformer under autocast in that dtype, because RL
learning rates (~1e-6) are far below bf16's resolution of a weight (~1e-2 relative): pure-bf16
weights would round most updates away. The LM head and the processed softmax that give the
learner's log-probs always run in float32 (:mod:`trainer.algo.logprobs`). The generators load the
weights in the dtype itself. ``auto`` is bfloat16 on CUDA and float32 on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.errors import ConfigError, ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files one of which a transformers tokenizer folder holds (fast, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; ConfigError
    naming ``[model].device`` when this machine cannot run it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f'[model].device = "{name}" but this machine has no CUDA device (torch '
                f'{torch.__version__}); set [model].device = "cpu" or "auto"'
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f'[model].device = "{name}" but this machine has {torch.cuda.device_count()} '
                f'CUDA device(s); use cuda:0..cuda:{torch.cuda.device_count() - 1} or "auto"'
            )
    return device


def resolve_dtype(name: str, device: torch.device, key: str = "[model].dtype") -> torch.dtype:
    """``auto`` (bfloat16 on CUDA, float32 on CPU) or a named dtype; ConfigError naming ``key``
    when ``device`` cannot compute in it."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"{key} = {name!r}: choose one of auto, {', '.join(DTYPES)}")
    dtype = DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        # CPU float16 matmuls are emulated (slow) and vLLM's CPU backend refuses float16.
        raise ConfigError(
            f'{key} = "float16" is not supported on CPU; use "bfloat16" or "float32" '
            '(or "auto": float32 on CPU)'
        )
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f'{key} = "bfloat16" but {torch.cuda.get_device_name(device)} has no bfloat16 '
            'support; use "float16" or "float32"'
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def check_attn_implementation(name: str) -> None:
    """ConfigError naming ``[model].attn_implementation`` when this machine cannot run it."""
    if name == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                '[model].attn_implementation = "flash_attention_2" needs the flash-attn package '
                '(pip install flash-attn, CUDA only); use "sdpa"'
            )
        if not torch.cuda.is_available():
            raise ConfigError(
                '[model].attn_implementation = "flash_attention_2" runs on CUDA only; use "sdpa"'
            )


def load_model(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """(model, tokenizer) of a model folder; weights in ``dtype`` (the learner: float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    tok = AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )
    return model.to(dtype), tok


def check_model_dir(path: str | Path, key: str = "[model].path", *, tokenizer: bool = True) -> Path:
    """``path`` as a model folder, or ModelError naming ``key`` (the config key or flag that
    gave it) and what is missing (before any run state is written, so a typo leaves nothing
    behind). ``tokenizer``: the folder must hold the tokenizer too."""
    path = Path(path)
    tiny = ' or "tiny"' if key in ("[model].path", "--model") else ""
    if not path.is_dir():
        raise ModelError(
            f"{key} {str(path)!r}: no such folder; give a local model folder (a "
            f"transformers save_pretrained folder with config.json){tiny}"
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{key} {str(path)!r} has no config.json: give the folder that "
            f"save_pretrained wrote (weights, config.json, tokenizer files)"
        )
    if tokenizer:
        check_tokenizer_dir(path, key)
    return path


def check_tokenizer_dir(path: str | Path, key: str) -> Path:
    """``path`` as a folder holding a tokenizer, or ModelError naming ``key``."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{key} {str(path)!r}: no such folder; give the tokenizer's folder")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(
            f"{key} {str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            f"save the tokenizer into the folder too (tokenizer.save_pretrained(path))"
        )
    return path


def check_no_remote_code(path: Path) -> None:
    """ConfigError naming ``[model].trust_remote_code`` when the folder's model type exists only
    in its own code (``auto_map`` in config.json, a type transformers does not know)."""
    import json

    from transformers import CONFIG_MAPPING

    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading reports it
    model_type = cfg.get("model_type")
    if cfg.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"[model].path {str(path)!r} is a {model_type!r} model defined by the folder's own "
            f"code (auto_map in config.json): set [model].trust_remote_code = true if you trust it"
        )


def check_model(model_cfg: Any) -> None:
    """Everything about ``[model]`` that depends on this machine or the folder, checked before
    any run state is written: the folder (and its own code without trust_remote_code), the
    device, the dtype on it, the attention, and peft for ``[model.lora]``."""
    if model_cfg.path != "tiny":
        check_model_dir(model_cfg.path)
        if not model_cfg.trust_remote_code:
            check_no_remote_code(Path(model_cfg.path))
    device = resolve_device(model_cfg.device)
    resolve_dtype(model_cfg.dtype, device)
    check_attn_implementation(model_cfg.attn_implementation)
    if getattr(model_cfg, "lora", None) is not None:
        from trainer.models.lora import require_peft

        require_peft()
