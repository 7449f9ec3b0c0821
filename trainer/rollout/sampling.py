"""One set of sampling settings, validated once, shared by both generators and every loop.

``[generation]`` in a run config (:class:`trainer.config.GenerationConfig`), ``rolloutstore
generate`` and the generators' ``generate(...)`` keyword arguments all go through
:class:`SamplingParams`; the learner scores rows with the same temperature / top-k / top-p.
"""

from __future__ import annotations

import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rolloutstore.options import help_field as _h
from trainer.errors import ConfigError

# What behavior_logprobs hold for rows our generators sample: the log-prob of each token under
# the distribution it was drawn from (after temperature, top-k and top-p).
LOGPROBS_MODE = "processed_logprobs"

Backend = Literal["hf", "vllm", "auto"]
# What a prompt too long for the model's context becomes (trainer/tasks/chat.py fit_prompts).
PromptOverflow = Literal["error", "truncate_left", "skip"]
GenDtype = Literal["auto", "float32", "bfloat16", "float16"]
Eager = Literal["auto", True, False]
EngineLog = Literal["quiet", "all"]
# max_model_len when the config leaves it 0: the model's max_position_embeddings, capped here
# (a 128k-context model would otherwise reserve KV cache for sequences RL never produces).
MAX_MODEL_LEN_CAP = 8192


def _not_int(v: object) -> bool:
    return isinstance(v, bool) or not isinstance(v, int)


def check_processing(temperature: Any, top_p: Any, top_k: Any) -> None:
    """The logit-processing settings the generators and the learner share (ValueError)."""
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; greedy decoding is not supported "
            "because its behaviour log-probs are degenerate"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if _not_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings, as the generators take them and rows record them: off is
    ``top_k=0`` / ``top_p=1.0`` (None is accepted for either and stored so)."""

    group_size: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.top_k is None:
            object.__setattr__(self, "top_k", 0)
        if self.top_p is None:
            object.__setattr__(self, "top_p", 1.0)
        if _not_int(self.group_size) or self.group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {self.group_size!r}")
        check_processing(self.temperature, self.top_p, self.top_k)
        if _not_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if _not_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a generator's ``generate(prompts, **kwargs)``."""
        return asdict(self)


def check_generate_args(prompts: Any, **sampling: Any) -> SamplingParams:
    """The checks every generator's ``generate`` shares; ValueError naming the bad value."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of str")
    return SamplingParams(**sampling)


@dataclass(frozen=True)
class Sampled:
    """One continuation of a token-id context (a generator's ``sample``): its tokens, their
    behaviour log-probs, and why it ended: ``stop`` (EOS), ``stop_string`` (the turn text
    contains one of the stop strings; the token that completed it is the last one) or
    ``length`` (the ``max_tokens`` budget)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "stop_string", "length"]


def stop_position(
    decode: Callable[[list[int]], str], token_ids: list[int], stop: Sequence[str]
) -> int | None:
    """The smallest ``n`` such that ``decode(token_ids[:n])`` contains one of ``stop``, or None.

    The one stop-string rule of both generators (vLLM's: a turn ends with the token that
    completes a stop string, also when that token runs past it). Containment grows with the
    prefix, so a binary search needs O(log n) decodes.
    """
    if not stop or not any(s in decode(token_ids) for s in stop):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(token_ids[:mid]) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    return lo


def check_sample_args(
    contexts: Any, max_tokens: Any, seed: Any, stop: Any
) -> tuple[list[int], list[str]]:
    """The checks of both generators' ``sample``: the per-context budgets (``max_tokens``, one
    int for all or one per context) and the stop strings; ValueError naming the bad value."""
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty str, got {stop!r}")
    budgets = [max_tokens] * len(contexts) if not isinstance(max_tokens, list) else max_tokens
    if len(budgets) != len(contexts) or any(_not_int(b) or b < 1 for b in budgets):
        raise ValueError(
            f"max_tokens must be an int >= 1 or one such int per context, got {max_tokens!r}"
        )
    if _not_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context must hold at least one token")
    return budgets, list(stop)


@dataclass(frozen=True)
class GenerationConfig:
    backend: Backend = _h("hf (transformers), vllm, or auto (vllm when installed)", "hf")
    group_size: int = _h("samples per prompt (GRPO group)", 8)
    temperature: float = _h("sampling temperature (> 0)", 1.0)
    top_p: float | None = _h("nucleus threshold in (0, 1); None (or 1.0): off", None)
    top_k: int | None = _h("top-k cut-off, an int >= 1; None (or 0): off", None)
    max_tokens: int = _h("completion token budget", 16)
    advantage_ddof: int = _h(
        "group advantage std: 0 population (default), 1 sample std (verl / TRL convention)", 0
    )
    prompts_per_round: int = _h("prompts generated per round", 32)
    batch_prompts: int = _h("prompts per generation call (one atomic append each)", 64)
    prompt_overflow: PromptOverflow = _h(
        "a prompt whose tokens + max_tokens exceed the model's context (max_position_embeddings; "
        "vLLM: max_model_len): error (refuse the round), truncate_left (cut its start; "
        "plain-text prompts only) or skip (leave it out, counted as prompts_skipped)",
        "error",
    )
    # vLLM engine settings (the transformers backend uses dtype only).
    max_model_len: int = _h(
        f"vLLM: longest prompt + completion; 0: the model's max_position_embeddings, at most "
        f"{MAX_MODEL_LEN_CAP}",
        0,
    )
    gpu_memory_utilization: float = _h(
        "vLLM: fraction of the GPU's memory the engine may use (weights + KV cache); 0: 0.5 on "
        "GPU (the sync learner shares it), 0.05 on CPU (where the KV cache is kv_cache_gib)",
        0.0,
    )
    kv_cache_gib: float = _h(
        "vLLM KV cache size in GiB; 0: 0.5 GiB on CPU, gpu_memory_utilization decides on GPU",
        0.0,
    )
    tensor_parallel_size: int = _h("vLLM: GPUs one engine spans", 1)
    dtype: GenDtype = _h(
        "generator precision: auto (the learner's [model].dtype), float32, bfloat16, float16",
        "auto",
    )
    enforce_eager: Eager = _h(
        "vLLM: true runs eagerly (no torch.compile, no CUDA graphs: a faster start; on GPU "
        "slower decoding), false compiles (CPU: torch.compile, ~50 s more per engine start, no "
        "decoding gain measured here); auto: eager on CPU, compiled on GPU",
        "auto",
    )
    engine_log: EngineLog = _h(
        "vLLM: quiet sends the engine's output to RUN_DIR/engine.log (the terminal shows only "
        "warnings to act on), all prints it all to the terminal",
        "quiet",
    )
    # Multi-turn rollouts ([task].tools; trainer/rollout/multiturn.py).
    max_turns: int = _h(
        "model turns per trajectory (> 1 needs [task].tools; max_tokens is each turn's budget)", 1
    )
    max_total_tokens: int = _h(
        "multi-turn: completion tokens per trajectory, model and tool tokens together (0: no "
        "cap beyond max_turns x max_tokens plus the tool outputs)",
        0,
    )

    def __post_init__(self) -> None:
        if self.backend not in typing.get_args(Backend):
            raise ValueError(
                f"backend must be one of {typing.get_args(Backend)}, got {self.backend!r}"
            )
        # One "off" in the config and at the learner: None. 0 / 1.0, as rows store it and older
        # configs wrote it, read as None.
        for key, off in (("top_k", 0), ("top_p", 1)):
            value = getattr(self, key)
            if value == off and not isinstance(value, bool):
                object.__setattr__(self, key, None)
        self.sampling()  # the sampling fields, validated as every generator validates them
        if self.advantage_ddof not in (0, 1) or isinstance(self.advantage_ddof, bool):
            raise ValueError(f"advantage_ddof must be 0 or 1, got {self.advantage_ddof!r}")
        for name in ("prompts_per_round", "batch_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_overflow not in typing.get_args(PromptOverflow):
            raise ConfigError(
                f"[generation].prompt_overflow = {self.prompt_overflow!r}: choose one of "
                f"{', '.join(typing.get_args(PromptOverflow))}"
            )
        self._check_engine()
        self._check_turns()

    def model_token_budget(self) -> int:
        """The most policy-sampled (loss-mask 1) tokens one trajectory can hold: ``max_tokens``
        per model turn, ``max_turns`` turns, within ``max_total_tokens`` when set (the
        constant of Dr. GRPO's length normaliser; tool tokens carry no loss)."""
        budget = self.max_turns * self.max_tokens
        return min(budget, self.max_total_tokens) if self.max_total_tokens else budget

    def _check_turns(self) -> None:
        if _not_int(self.max_turns) or self.max_turns < 1:
            raise ConfigError(f"[generation].max_turns must be an int >= 1, got {self.max_turns!r}")
        t = self.max_total_tokens
        if _not_int(t) or t < 0 or 0 < t < self.max_tokens:
            raise ConfigError(
                f"[generation].max_total_tokens must be 0 (no cap) or an int >= max_tokens "
                f"({self.max_tokens}), got {t!r}"
            )
        if 0 < self.max_model_len <= t:
            raise ConfigError(
                f"[generation].max_model_len = {self.max_model_len} leaves no room for a prompt "
                f"beside max_total_tokens = {t}: raise it (or 0: from the model)"
            )

    def _check_engine(self) -> None:
        def bad(key: str, want: str) -> ConfigError:
            return ConfigError(f"[generation].{key} must be {want}, got {getattr(self, key)!r}")

        if _not_int(self.max_model_len) or self.max_model_len < 0:
            raise bad("max_model_len", "an int >= 0 (0: from the model's config)")
        if 0 < self.max_model_len <= self.max_tokens:
            raise ConfigError(
                f"[generation].max_model_len = {self.max_model_len} leaves no room for a prompt "
                f"beside max_tokens = {self.max_tokens}: raise it (or 0: from the model)"
            )
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 <= g <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1] (0: automatic)")
        k = self.kv_cache_gib
        if isinstance(k, bool) or not isinstance(k, int | float) or k < 0:
            raise bad("kv_cache_gib", "a number of GiB >= 0 (0: automatic)")
        if _not_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "an int >= 1")
        if self.dtype not in typing.get_args(GenDtype):
            raise bad("dtype", f"one of {', '.join(typing.get_args(GenDtype))}")
        if not (isinstance(self.enforce_eager, bool) or self.enforce_eager == "auto"):
            raise bad("enforce_eager", 'true, false or "auto"')
        if self.engine_log not in typing.get_args(EngineLog):
            raise bad("engine_log", '"quiet" or "all"')

    def engine_options(self) -> dict[str, Any]:
        """The vLLM engine keyword arguments of :class:`trainer.rollout.vllm.VLLMGenerator`."""
        return {
            "max_model_len": self.max_model_len or None,
            "gpu_memory_utilization": float(self.gpu_memory_utilization) or None,
            "kv_cache_gib": float(self.kv_cache_gib) or None,
            "tensor_parallel_size": self.tensor_parallel_size,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
        }

    def sampling(self, *, group_size: int | None = None, seed: int = 0) -> SamplingParams:
        """These settings as generator arguments (``group_size`` overrides, e.g. 1 for evals)."""
        return SamplingParams(
            group_size=self.group_size if group_size is None else group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            seed=seed,
        )


@dataclass(frozen=True)
class Sample:
    """One sampled completion of a prompt, as a generator's ``generate_samples`` returns it
    (multi-turn: :func:`trainer.rollout.multiturn.multiturn_samples`): the prompt it continues
    (``prompt_index`` into the call's prompts, and their token ids), its place in the prompt's
    group, the completion's tokens, text, behaviour log-probs and finish reason, and for a
    multi-turn trajectory its ``loss_mask`` and ``turns``. No ids and no reward: a generation
    round builds its rows with those (trainer/rollout/pipeline.py)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_text: str
    logprobs: list[float]
    finish_reason: str
    loss_mask: list[int] | None = None
    turns: list[dict[str, Any]] | None = None


def sample_columns(
    gen: Any, prompt_text: str, sample: Sample, sampling: SamplingParams
) -> dict[str, Any]:
    """The store columns sampling decides for ``sample``, the same keys from every generator:
    tokens, text, log-probs, the settings, and what ``gen`` records of itself (name, policy
    version and id, tokenizer fingerprint); ``loss_mask`` and ``turns`` for a trajectory."""
    row = {
        "prompt_ids": list(sample.prompt_ids),
        "completion_ids": sample.completion_ids,
        "behavior_logprobs": sample.logprobs,
        "prompt_text": prompt_text,
        "completion_text": sample.completion_text,
        "finish_reason": sample.finish_reason,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_tokens": int(sampling.max_tokens),
        "seed": int(sampling.seed),
        "logprobs_mode": LOGPROBS_MODE,
        "generator": gen.generator_name,
        "policy_version": gen.policy_version,
        "policy_id": gen.policy_id,
        "tokenizer_fingerprint": gen.tokenizer_fingerprint,
        "sample_index": sample.sample_index,
    }
    if sample.turns is not None:
        row["loss_mask"] = sample.loss_mask
        row["turns"] = sample.turns
    return row


def standalone_rows(
    gen: Any, prompts: Sequence[str], samples: list[Sample], sampling: SamplingParams
) -> list[dict[str, Any]]:
    """``samples`` of ``prompts`` as row dicts outside a generation round (a generator's
    ``generate``: evaluation, weight checks, scripts): :func:`sample_columns` plus a fresh
    random ``group_id`` per prompt. A round's rows get the round's ids, rewards, advantages and
    embeddings in one place, trainer/rollout/pipeline.py."""
    group_ids = [uuid.uuid4().hex for _ in prompts]
    return [
        {
            **sample_columns(gen, prompts[s.prompt_index], s, sampling),
            "group_id": group_ids[s.prompt_index],
        }
        for s in samples
    ]
