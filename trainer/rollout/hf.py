"""Sample rollouts with Hugging Face ``transformers`` and record behaviour log-probs.

:class:`HFGenerator` is the reference (CPU-friendly) generation backend: it samples
``group_size`` completions per prompt with ``model.generate`` and returns one
:class:`~trainer.rollout.sampling.Sample` per completion (``generate_samples``: tokens, text,
log-probs, finish reason; no ids), or one row dict in the store's field names (``generate``,
outside a generation round). ``behavior_logprobs`` are log-probs of the sampled
tokens under the *processed* distribution they were drawn from (temperature, then top-k, then
top-p), i.e. ``log_softmax`` of the ``scores`` that ``generate(output_scores=True)`` returns --
transformers samples from ``softmax(scores)`` and stores exactly those tensors.
:func:`teacher_forced_logprobs` recomputes the same quantity from a single forward pass; the two
agree to float32 precision for the same weights (see tests/trainer/test_hf_generate.py).

Greedy decoding (``temperature=0``) is rejected: the behaviour policy would be a point mass whose
log-probs are all 0, which importance-weighted off-policy losses cannot use.

Example::

    gen = HFGenerator("/tmp/tiny", policy_version=3)
    rollouts = gen.generate(["Compute 2+3. Answer:"], group_size=4, temperature=0.7, seed=1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.algo.logprobs import top_p_keep
from trainer.rollout.sampling import (
    Sample,
    Sampled,
    SamplingParams,
    check_generate_args,
    check_processing,
    check_sample_args,
    standalone_rows,
    stop_position,
)
from trainer.tasks.chat import check_fits, encode_prompt


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Apply temperature, top-k, then top-p to ``(..., vocab)`` logits; filtered entries -> -inf.

    Mirrors the order and tie/threshold rules of transformers' sampling warpers and vLLM's
    sampler: top-k keeps every logit >= the k-th largest (ties survive); top-p (on the
    top-k-filtered distribution) drops the tokens whose ascending cumulative probability is
    <= 1 - top_p, always keeping the most likely token (:func:`trainer.algo.logprobs.top_p_keep`,
    which the learner uses too).
    """
    check_processing(temperature, top_p, top_k)
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if 0 < top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        scores = scores.masked_fill(~top_p_keep(scores, top_p), float("-inf"))
    return scores


def teacher_forced_logprobs(
    model: Any,
    prompt_ids: list[int] | torch.Tensor,
    completion_ids: list[int] | torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """Log-probs (float32, one per completion token) of ``completion_ids`` after ``prompt_ids``.

    Runs one unpadded forward pass over prompt + completion, applies :func:`process_logits`
    with the sampling settings and gathers each completion token's log-prob. Gradients flow if
    the caller has them enabled; wrap in ``torch.no_grad()`` for evaluation.
    """
    check_processing(temperature, top_p, top_k)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    completion = torch.as_tensor(completion_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() == 0:
        raise ValueError("prompt_ids must be non-empty (the first completion token needs context)")
    if completion.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    device = next(model.parameters()).device
    ids = torch.cat([prompt, completion]).to(device)[None]
    logits = model(input_ids=ids).logits[0]
    # The logit at position i predicts token i + 1.
    start = prompt.numel() - 1
    step_logits = logits[start : start + completion.numel()]
    logp = torch.log_softmax(process_logits(step_logits, temperature, top_p, top_k), dim=-1)
    return logp.gather(-1, completion.to(device)[:, None]).squeeze(-1).float()


def max_logprob_gap(model: Any, rows: list[dict[str, Any]]) -> float:
    """Largest |stored behaviour log-prob - teacher-forced log-prob| over generated ``rows``.

    Recomputes each row under its own recorded temperature/top-p/top-k with ``model``;
    this is the train/inference mismatch check (0 for a generator that holds ``model``).
    """
    return logprob_gaps(model, rows)["max"]


def logprob_gaps(model: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-token |behaviour - teacher-forced| log-prob gaps of ``rows`` under ``model``:
    ``max``, ``mean`` (finite gaps), ``clipped_mean`` (each gap clipped at 1 nat, so a top-p
    boundary flip counts 1), ``flips`` (tokens -inf on one side only) and ``tokens``."""
    gaps = []
    with torch.no_grad():
        for r in rows:
            if not r["completion_ids"]:
                continue
            tf = teacher_forced_logprobs(
                model,
                r["prompt_ids"],
                r["completion_ids"],
                r["temperature"],
                r["top_p"],
                r["top_k"],
            )
            if tf.shape != (len(r["completion_ids"]),):
                raise ValueError(f"teacher-forced shape {tuple(tf.shape)} != completion length")
            behaviour = torch.tensor(r["behavior_logprobs"], dtype=torch.float32)
            gaps.append((tf.cpu() - behaviour).abs())
    if not gaps:
        return {"max": 0.0, "mean": 0.0, "clipped_mean": 0.0, "flips": 0, "tokens": 0}
    g = torch.cat(gaps)
    finite = g[torch.isfinite(g)]
    return {
        "max": float(g.max()),
        "mean": float(finite.mean()) if finite.numel() else 0.0,
        "clipped_mean": float(g.clamp(max=1.0).mean()),
        "flips": int((~torch.isfinite(g)).sum()),
        "tokens": int(g.numel()),
    }


class HFGenerator:
    """Batched sampling with transformers: :class:`Sample` objects, or rollout row dicts.

    ``max_batch_size`` bounds how many sequences go through one ``generate`` call (the scores
    of every step are kept, ``batch x steps x vocab`` floats); chunks draw from one seeded RNG
    stream, so results do not depend on the host's global RNG state.

    ``device`` and ``dtype`` follow ``[model]``: ``auto`` is CUDA when available, and bfloat16
    on CUDA, float32 on CPU; the weights are held in ``dtype``.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        policy_version: int = 0,
        policy_id: str | None = None,
        max_batch_size: int | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if isinstance(policy_version, bool) or not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be None or >= 1, got {max_batch_size}")
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from trainer.models.load import resolve_device, resolve_dtype
        from trainer.models.tokenizer import tokenizer_fingerprint

        self.model_path = Path(model_path)
        self.device = resolve_device(device) if isinstance(device, str) else torch.device(device)
        if isinstance(dtype, str):
            dtype = resolve_dtype(dtype, self.device)
        self.dtype = dtype
        self.policy_version = policy_version
        self.policy_id = policy_id
        self.max_batch_size = max_batch_size
        self.generator_name = f"transformers/{transformers.__version__}"

        self.tokenizer = AutoTokenizer.from_pretrained(
            str(model_path), local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.tokenizer.padding_side = "left"
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path),
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            **extra,
        )
        # Cast explicitly: older transformers ignore the ``dtype`` keyword (it was ``torch_dtype``).
        self.model = model.to(device=self.device, dtype=dtype).eval()
        # The context a prompt + completion must fit (vLLM's name for it; None: unknown).
        # transformers only warns past it and then samples from positions the model never saw.
        self.max_model_len: int | None = getattr(model.config, "max_position_embeddings", None)

        eos: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            eos.update([source] if isinstance(source, int) else source)
        if not eos:
            raise ValueError(
                f"{model_path}: neither the tokenizer nor the model defines an EOS token"
            )
        self.eos_token_ids = sorted(eos)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]
        # A checkpoint's generation_config may carry repetition penalties, min_p, default top_k
        # and so on, which generate() would silently merge in; the recorded log-probs are only
        # right if temperature/top-k/top-p are the whole processing chain.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id
        )
        self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)

    @torch.no_grad()
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
        """Sample ``group_size`` completions per prompt; one :class:`Sample` each, prompt-major."""
        check_generate_args(
            prompts, group_size=group_size, temperature=temperature, top_p=top_p, top_k=top_k,
            max_tokens=max_tokens, seed=seed,
        )  # fmt: skip
        if not prompts:
            return []

        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        if any(len(ids) == 0 for ids in prompt_ids):
            raise ValueError("every prompt must tokenize to at least one token")
        check_fits(prompt_ids, max_tokens, self.max_model_len)
        rows = [(i, j) for i in range(len(prompts)) for j in range(group_size)]

        contexts = [prompt_ids[i] for i, _ in rows]
        sampled = self._sample_seeded(contexts, temperature, top_p, top_k, max_tokens, seed, [])
        out = []
        for (i, j), (completion_ids, logprobs) in zip(rows, sampled):
            finished = bool(completion_ids) and completion_ids[-1] in self.eos_token_ids
            reason = "stop" if finished else "length"
            text = self._decode(completion_ids)
            out.append(Sample(i, j, prompt_ids[i], completion_ids, text, logprobs, reason))
        return out

    def generate(self, prompts: list[str], **sampling: Any) -> list[dict[str, Any]]:
        """:meth:`generate_samples` as row dicts with fresh group ids (outside a generation
        round: :func:`trainer.rollout.sampling.standalone_rows`)."""
        samples = self.generate_samples(prompts, **sampling)
        return standalone_rows(self, prompts, samples, SamplingParams(**sampling))

    @torch.no_grad()
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

        Sampling and log-probs are those of :meth:`generate`; a continuation also ends with the
        token that completes one of ``stop`` (:func:`trainer.rollout.sampling.stop_position`).
        ``max_tokens``: one budget for all, or one per context (the batch samples up to the
        largest; each continuation is cut at its own, a prefix of what it sampled).
        """
        check_processing(temperature, top_p, top_k)
        budgets, stop = check_sample_args(contexts, max_tokens, seed, stop)
        if not contexts:
            return []
        for ids, budget in zip(contexts, budgets):
            check_fits([ids], budget, self.max_model_len)
        sampled = self._sample_seeded(contexts, temperature, top_p, top_k, max(budgets), seed, stop)
        out = []
        for (ids, lps), budget in zip(sampled, budgets):
            if len(ids) > budget:  # no EOS or stop string within its own budget
                ids, lps, reason = ids[:budget], lps[:budget], "length"
            elif ids and ids[-1] in self.eos_token_ids:
                reason = "stop"
            elif stop and stop_position(self._decode, ids, stop) == len(ids):
                reason = "stop_string"
            else:
                reason = "length"
            out.append(Sampled(ids, lps, reason))
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _sample_seeded(
        self,
        contexts: list[list[int]],
        temperature: float,
        top_p: float,
        top_k: int,
        max_tokens: int,
        seed: int,
        stop: list[str],
    ) -> list[tuple[list[int], list[float]]]:
        """Chunks of ``max_batch_size`` contexts, sampled from one RNG stream seeded ``seed``."""
        chunk = self.max_batch_size or len(contexts)
        sampled: list[tuple[list[int], list[float]]] = []
        fork_devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(seed)
            for start in range(0, len(contexts), chunk):
                batch = contexts[start : start + chunk]
                sampled.extend(
                    self._generate_batch(batch, temperature, top_p, top_k, max_tokens, stop)
                )
        return sampled

    def _generate_batch(
        self,
        batch: list[list[int]],
        temperature: float,
        top_p: float,
        top_k: int,
        max_tokens: int,
        stop: list[str] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, ids in enumerate(batch):
            # Left padding keeps every row's last prompt token at the same (final) position.
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[r, width - len(ids) :] = 1
        # Stop strings end a row's turn early (multi-turn); without them nothing changes.
        extra = {"stopping_criteria": _stop_criteria(self, stop, width)} if stop else {}
        result = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
        generated = result.sequences[:, width:].cpu()
        # One (batch,) vector per step: the sampled token's log-prob under softmax(scores).
        step_logprobs = torch.stack(
            [
                torch.log_softmax(s.float(), dim=-1)
                .gather(-1, generated[:, t : t + 1].to(s.device))
                .squeeze(-1)
                .cpu()
                for t, s in enumerate(result.scores)
            ],
            dim=1,
        )
        eos = torch.tensor(self.eos_token_ids)
        out = []
        for r in range(len(batch)):
            tokens = generated[r]
            hits = torch.isin(tokens, eos).nonzero()
            # Everything after the first EOS is padding generate() filled in for a finished row.
            n = int(hits[0, 0]) + 1 if hits.numel() else tokens.numel()
            if stop:  # ... or after the token that completed a stop string, if that came first
                n = stop_position(self._decode, tokens[:n].tolist(), stop) or n
            out.append((tokens[:n].tolist(), step_logprobs[r, :n].tolist()))
        return out


def _stop_criteria(gen: HFGenerator, stop: list[str], width: int) -> Any:
    """A transformers stopping criterion: a row is done once its text since position ``width``
    contains one of ``stop`` (rows stopped earlier stay done; the batch ends when all are)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _StopStrings(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            done = [any(s in gen._decode(row[width:].tolist()) for s in stop) for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_StopStrings()])
