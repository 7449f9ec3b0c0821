"""Held-out evaluation: the ``[eval]`` config section, its statistics, and the eval itself.

    [eval]
    prompts = 64             # held-out prompts (the task's eval split)
    samples_per_prompt = 4   # sampled completions per prompt (pass@k up to 4)
    greedy = false           # true: one greedy completion per prompt
    temperature = 0.6        # sampled evals (unset: [generation].temperature)
    every = 10               # learner steps between evaluations (0: only at the start and end)

:func:`evaluate` scores ``prompts`` held-out prompts and returns an :class:`EvalResult`: the
mean reward over prompts with its standard error (the spread of the per-prompt means over
the prompts, so that samples of one prompt are not counted as independent), and with more
than one sample per prompt pass@k by the unbiased estimator (Chen et al. 2021:
``1 - C(n-c, k) / C(n, k)`` for ``c`` correct of ``n`` samples) for k = 1, 2, 4, ... n.

Eval prompts follow ``[generation] prompt_overflow`` as training prompts do
(:func:`trainer.tasks.chat.fit_prompts`): too long for the generator's context beside
``max_tokens``, they are refused, cut from the left, or left out; the result counts them
(``prompts_skipped``, ``prompts_truncated``) and the reward is over the prompts scored.

Greedy decoding is refused for training (a point mass has no behaviour log-probs the
learner can use), but an eval keeps no log-probs: a greedy eval asks the generator's model
(transformers) or engine (vLLM) for its argmax continuation directly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutstore.options import help_field as _h

# The held-out prompts and the sampling of an eval: fixed per run seed, the same at every eval.
PROMPT_SEED = 10_000_019
SAMPLE_SEED = 99


@dataclass(frozen=True)
class EvalConfig:
    """[eval]: how the held-out evaluation samples and how often it runs."""

    prompts: int = _h("held-out prompts scored at each eval (0: no evals)", 64)
    every: int = _h("learner steps between evaluations (0: only at the start and the end)", 10)
    samples_per_prompt: int = _h(
        "sampled completions per prompt (pass@k is reported for k = 1, 2, 4, ... up to it)", 1
    )
    greedy: bool = _h("one greedy (argmax) completion per prompt instead of sampling", False)
    temperature: float | None = _h(
        "sampling temperature of a sampled eval (unset: [generation].temperature)", None
    )

    def __post_init__(self) -> None:
        from trainer.errors import ConfigError

        for key, low in (("prompts", 0), ("every", 0), ("samples_per_prompt", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"[eval].{key} must be an int >= {low}, got {v!r}")
        if not isinstance(self.greedy, bool):
            raise ConfigError(f"[eval].greedy must be true or false, got {self.greedy!r}")
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise ConfigError(
                f"[eval].temperature must be a number > 0, got {t!r} (for greedy decoding "
                "set [eval].greedy = true)"
            )
        if self.greedy and self.samples_per_prompt != 1:
            raise ConfigError(
                f"[eval].greedy = true gives one answer per prompt, every sample the same: "
                f"set samples_per_prompt = 1 (got {self.samples_per_prompt}) or greedy = false"
            )
        if self.greedy and t is not None:
            raise ConfigError(
                "[eval].temperature has no effect with greedy = true: remove it, or set "
                "greedy = false to sample at it"
            )


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: ``reward`` (mean over prompts of the per-prompt mean), its standard
    error ``reward_se`` (nan with one prompt), ``pass_at`` ({k: pass@k}, empty with one
    sample per prompt), the counts, and the seconds it took."""

    reward: float
    reward_se: float
    pass_at: dict[int, float]
    prompts: int
    samples_per_prompt: int
    greedy: bool
    seconds: float
    # Eval prompts too long for the context ([generation].prompt_overflow): not in `prompts`.
    prompts_skipped: int = 0
    prompts_truncated: int = 0

    def record(self) -> dict[str, Any]:
        """The metrics record's fields (``pass@K`` keys, as TensorBoard tags them)."""
        return {
            "reward": self.reward,
            "reward_se": self.reward_se,
            **{f"pass@{k}": v for k, v in self.pass_at.items()},
            "eval_prompts": self.prompts,
            "samples_per_prompt": self.samples_per_prompt,
            "greedy": self.greedy,
            "eval_prompts_skipped": self.prompts_skipped,
            "eval_prompts_truncated": self.prompts_truncated,
            "seconds": self.seconds,  # this eval's (eval_seconds in the totals: all evals')
        }

    def line(self) -> str:
        """``0.312 ± 0.058 (64 prompts x 4, pass@4 0.520)``."""
        how = "greedy" if self.greedy else f"x {self.samples_per_prompt}"
        out = f"{self.reward:.3f} ± {self.reward_se:.3f} ({self.prompts} prompts {how}"
        if self.pass_at:
            k = max(self.pass_at)
            out += f", pass@{k} {self.pass_at[k]:.3f}"
        if self.prompts_skipped:
            out += f"; {self.prompts_skipped} too long, skipped"
        if self.prompts_truncated:
            out += f"; {self.prompts_truncated} cut to fit"
        return out + ")"


def mean_and_se(per_prompt: np.ndarray) -> tuple[float, float]:
    """Mean reward and its standard error from ``(P, S)`` rewards (P prompts, S samples each).

    The prompts are the independent draws: SE = std(per-prompt means, ddof=1) / sqrt(P); with
    one sample per prompt that is the usual std / sqrt(n). Nan SE for a single prompt."""
    r = np.asarray(per_prompt, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"expected (prompts, samples) rewards, got shape {r.shape}")
    means = r.mean(axis=1)
    se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else math.nan
    return float(means.mean()), se


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``c`` correct of ``n`` samples (Chen et al. 2021):
    the chance that k of the n, drawn without replacement, hold at least one correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k of the reported pass@k for ``n`` samples per prompt: 1, 2, 4, ... and n."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def evaluate(generator: Any, task: Any, cfg: EvalConfig, generation: Any, seed: int) -> EvalResult:
    """Score ``cfg.prompts`` held-out prompts of ``task`` with ``generator`` (the same prompts
    and sampling seeds at every eval of a run with seed ``seed``); ``generation``: the run's
    GenerationConfig (max tokens, top-p/k, turns, and the temperature unless [eval] sets one)."""
    from dataclasses import replace

    from trainer.rollout.multiturn import samples_for_task
    from trainer.tasks import score_completion
    from trainer.tasks.chat import PromptTooLongError, fit_prompts, render_prompts

    t0 = time.perf_counter()
    prompts = render_prompts(
        generator.tokenizer, task.make_eval_prompts(cfg.prompts, seed=PROMPT_SEED + seed),
        task.chat_template,
    )  # fmt: skip
    # The rule generation applies, on the same generator: refuse, cut or leave out prompts
    # that do not fit its context beside max_tokens, before anything is sampled.
    fitted = fit_prompts(
        generator.tokenizer, prompts, max_tokens=generation.max_tokens,
        limit=getattr(generator, "max_model_len", None), policy=generation.prompt_overflow,
        record="eval record",
    )  # fmt: skip
    if not fitted.prompts:
        raise PromptTooLongError(
            f"all {len(prompts)} eval prompts are too long for the model's context beside "
            f"[generation].max_tokens = {generation.max_tokens}, so the eval has nothing to "
            'score: lower max_tokens or use prompt_overflow = "truncate_left"'
        )
    prompts = fitted.prompts
    texts = [p.prompt_text for p in prompts]
    m = cfg.samples_per_prompt
    if cfg.greedy:
        completions = greedy_completions(generator, texts, generation.max_tokens)
    else:
        g = (
            generation
            if cfg.temperature is None
            else replace(generation, temperature=cfg.temperature)
        )
        sampling = g.sampling(group_size=m, seed=seed + SAMPLE_SEED)
        samples = samples_for_task(
            generator, task, texts, max_turns=g.max_turns, max_total_tokens=g.max_total_tokens,
            **sampling.kwargs(),
        )  # fmt: skip
        completions = [s.completion_text for s in samples]  # prompt-major, m per prompt
    scored = [score_completion(task, prompts[k // m], c) for k, c in enumerate(completions)]
    rewards = np.array([s.reward for s in scored]).reshape(len(prompts), m)
    correct = np.array([bool(s.info.get("correct", s.reward > 0)) for s in scored])
    mean, se = mean_and_se(rewards)
    passes = {}
    if m > 1:
        counts = correct.reshape(len(prompts), m).sum(axis=1)
        passes = {k: float(np.mean([pass_at_k(m, int(c), k) for c in counts])) for k in pass_ks(m)}
    return EvalResult(
        mean, se, passes, len(prompts), m, cfg.greedy, time.perf_counter() - t0,
        prompts_skipped=len(fitted.skipped), prompts_truncated=len(fitted.truncated),
    )  # fmt: skip


def greedy_completions(generator: Any, prompts: list[str], max_tokens: int) -> list[str]:
    """The argmax continuation of each prompt, decoded: transformers ``generate`` without
    sampling, or a vLLM request at temperature 0 (neither records log-probs)."""
    import torch

    from trainer.tasks.chat import encode_prompt

    tokenizer = generator.tokenizer
    ids = [encode_prompt(tokenizer, p) for p in prompts]

    def decode(x: list[int]) -> str:  # as the generators decode a completion
        return tokenizer.decode(x, skip_special_tokens=True)

    llm = getattr(generator, "_llm", None)  # a VLLMGenerator's engine
    if llm is not None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        out = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        return [decode([int(t) for t in r.outputs[0].token_ids]) for r in out]
    model, pad = generator.model, generator.pad_token_id
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for r, x in enumerate(ids):  # left padding: every row's last prompt token at the end
        input_ids[r, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[r, width - len(x) :] = 1
    dev = next(model.parameters()).device
    with torch.no_grad():
        seqs = model.generate(
            input_ids=input_ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
            max_new_tokens=max_tokens,
        )  # fmt: skip
    eos = set(generator.eos_token_ids)
    out = []
    for row in seqs[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(decode(row[:cut]))
    return out
