"""Multi-turn rollouts: the model generates until it calls a tool, the tool answers, and so on.

:func:`multiturn_samples` drives either generator (``HFGenerator`` or ``VLLMGenerator``, both
have ``sample(contexts, ..., stop=...)``) through a :class:`trainer.tasks.tools.ToolEnv`:

1. every trajectory starts as its prompt's token ids (``group_size`` per prompt);
2. each turn continues all unfinished trajectories at once (one ``sample`` call, seeded
   :func:`turn_seed` ``(seed, turn)``) until EOS, a closing tool tag, the turn's ``max_tokens``
   or what is left of ``max_total_tokens``;
3. after a closing tag the tool's output is tokenized on its own and appended with
   ``loss_mask`` 0 and behaviour log-prob 0.0; model tokens keep the log-probs the generator
   recorded (the processed log-probs of single-turn generation, so a staleness-0 learner
   recomputes them);
4. a trajectory ends with ``finish_reason`` ``stop`` (EOS, or a turn that ended without a
   tool call), ``length`` (a turn's ``max_tokens``, ``max_total_tokens`` or the engine's
   ``max_model_len``; a tool output that does not fit is not appended) or ``max_turns`` (a
   tool call in the last allowed turn; it is not answered).

Samples are the single-turn ones (:class:`trainer.rollout.sampling.Sample`; their rows record
``max_tokens`` = each turn's budget) plus the schema-v2 columns ``loss_mask`` (one 0/1 per
completion token; 1 = sampled by the policy) and ``turns`` (``{role: "assistant"|"tool", start,
end, tool_name}``, offsets into ``completion_ids``, contiguous, covering it). Same seed, same
generator weights: same trajectories. :func:`samples_for_task` picks single- or multi-turn by
the task; ``generate_multiturn`` / ``generate_for_task`` give row dicts outside a round.

    from trainer.rollout.multiturn import generate_multiturn
    rows = generate_multiturn(gen, ["Compute 347+589. Answer:"], env=ToolEnv(["calculator"]),
                              group_size=4, max_tokens=24, max_turns=3, max_total_tokens=64)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.sampling import (
    Sample,
    SamplingParams,
    _not_int,
    check_generate_args,
    standalone_rows,
)
from trainer.tasks.chat import encode_prompt
from trainer.tasks.tools import ToolEnv


def turn_seed(seed: int, turn: int) -> int:
    """Seed of turn ``turn``'s sampling call in a call seeded ``seed`` (63-bit, deterministic)."""
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class _Trajectory:
    prompt: int
    sample_index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None

    def add(self, ids: list[int], logprobs: list[float], role: str, tool: str | None) -> None:
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [1 if role == "assistant" else 0] * len(ids)
        self.turns.append({"role": role, "start": start, "end": len(self.ids), "tool_name": tool})


def multiturn_samples(
    gen: Any,
    prompts: list[str],
    *,
    env: ToolEnv,
    group_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_tokens: int = 64,
    seed: int = 0,
    max_turns: int = 2,
    max_total_tokens: int = 0,
) -> list[Sample]:
    """``group_size`` tool-using trajectories per prompt, prompt-major, as :class:`Sample`
    objects with ``loss_mask`` and ``turns``; see the module doc.

    ``max_tokens`` bounds each model turn, ``max_total_tokens`` (0: no cap) the whole
    completion (model and tool tokens), ``max_turns`` the model turns.
    """
    _check_args(
        gen, prompts, group_size, temperature, top_p, top_k, max_tokens, seed, max_turns,
        max_total_tokens,
    )  # fmt: skip
    if not prompts:
        return []
    tok = gen.tokenizer
    prompt_ids = [encode_prompt(tok, p) for p in prompts]
    if any(not ids for ids in prompt_ids):
        raise ValueError("every prompt must tokenize to at least one token")
    trajs = [
        _Trajectory(i, j, list(prompt_ids[i]))
        for i in range(len(prompts))
        for j in range(group_size)
    ]
    model_len = getattr(gen, "max_model_len", None)
    for turn in range(max_turns):
        active, budgets = [], []
        for t in trajs:
            if t.finish is not None:
                continue
            budget = _budget(t, max_tokens, max_total_tokens, model_len)
            if budget < 1:
                t.finish = "length"
                continue
            active.append(t)
            budgets.append(budget)
        if not active:
            break
        outs = gen.sample(
            [t.prompt_ids + t.ids for t in active], temperature=temperature, top_p=top_p,
            top_k=top_k, max_tokens=budgets, seed=turn_seed(seed, turn), stop=env.stop_strings,
        )  # fmt: skip
        for t, out, budget in zip(active, outs, budgets):
            ids, lps, reason = out.token_ids, out.logprobs, out.finish_reason
            if not 1 <= len(ids) <= budget:
                raise RuntimeError(
                    f"{type(gen).__name__}.sample returned {len(ids)} tokens "
                    f"for a budget of {budget}"
                )
            t.add(ids, lps, "assistant", None)
            if reason != "stop_string":
                t.finish = reason
                continue
            reply = env.respond(tok.decode(ids, skip_special_tokens=True))
            if reply is None:  # the decoded turn lost its closing tag: nothing to answer
                t.finish = "stop"
                continue
            if turn + 1 == max_turns:
                t.finish = "max_turns"
                continue
            tool_ids = list(tok(reply.text, add_special_tokens=False)["input_ids"])
            room = _budget(t, len(tool_ids) + 1, max_total_tokens, model_len)
            if room < len(tool_ids) + 1:  # no room for the output and one more model token
                t.finish = "length"
                continue
            t.add(tool_ids, [0.0] * len(tool_ids), "tool", reply.tool_name)
    for t in trajs:
        if t.finish is None:  # unreachable: the last turn finishes every trajectory
            t.finish = "max_turns"
    return [
        Sample(
            t.prompt,
            t.sample_index,
            prompt_ids[t.prompt],
            t.ids,
            tok.decode(t.ids, skip_special_tokens=True),
            t.logprobs,
            t.finish,
            t.mask,
            t.turns,
        )  # fmt: skip
        for t in trajs
    ]


def generate_multiturn(
    gen: Any,
    prompts: list[str],
    *,
    env: ToolEnv,
    max_turns: int = 2,
    max_total_tokens: int = 0,
    **sampling: Any,
) -> list[dict[str, Any]]:
    """:func:`multiturn_samples` as row dicts with fresh group ids (outside a generation round:
    :func:`trainer.rollout.sampling.standalone_rows`)."""
    samples = multiturn_samples(
        gen, prompts, env=env, max_turns=max_turns, max_total_tokens=max_total_tokens, **sampling
    )
    return standalone_rows(gen, prompts, samples, SamplingParams(**sampling))


def _check_args(
    gen: Any, prompts: list[str], group_size: int, temperature: float, top_p: float, top_k: int,
    max_tokens: int, seed: int, max_turns: int, max_total_tokens: int,
) -> None:  # fmt: skip
    """Refuse bad arguments before any sampling (generate's checks plus the turn limits)."""
    check_generate_args(
        prompts, group_size=group_size, temperature=temperature, top_p=top_p, top_k=top_k,
        max_tokens=max_tokens, seed=seed,
    )  # fmt: skip
    if _not_int(max_turns) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    if _not_int(max_total_tokens) or max_total_tokens < 0:
        raise ValueError(f"max_total_tokens must be an int >= 0, got {max_total_tokens!r}")
    if not callable(getattr(gen, "sample", None)):
        raise TypeError(
            f"{type(gen).__name__} has no sample(contexts, ..., stop=...): multi-turn rollouts "
            "need HFGenerator or VLLMGenerator"
        )


def _budget(t: _Trajectory, want: int, max_total: int, model_len: int | None) -> int:
    """Tokens ``t`` may still add, at most ``want``."""
    budget = want
    if max_total:
        budget = min(budget, max_total - len(t.ids))
    if model_len:
        budget = min(budget, model_len - len(t.prompt_ids) - len(t.ids))
    return budget


def samples_for_task(
    gen: Any,
    task: Any,
    prompts: list[str],
    *,
    max_turns: int = 1,
    max_total_tokens: int = 0,
    **sampling: Any,
) -> list[Sample]:
    """Samples of ``prompts``: multi-turn when ``task`` has tools (a ToolTask's ``env``), else
    ``gen.generate_samples`` as always (then ``max_turns`` must be 1)."""
    env = getattr(task, "env", None)
    if not isinstance(env, ToolEnv):
        if max_turns != 1:
            raise ValueError(
                f"max_turns = {max_turns} needs a task with tools ([task].tools): nothing "
                "answers the model between turns"
            )
        return gen.generate_samples(prompts, **sampling)
    return multiturn_samples(
        gen, prompts, env=env, max_turns=max_turns, max_total_tokens=max_total_tokens, **sampling
    )


def generate_for_task(
    gen: Any,
    task: Any,
    prompts: list[str],
    *,
    max_turns: int = 1,
    max_total_tokens: int = 0,
    **sampling: Any,
) -> list[dict[str, Any]]:
    """:func:`samples_for_task` as row dicts with fresh group ids (outside a generation round:
    :func:`trainer.rollout.sampling.standalone_rows`)."""
    samples = samples_for_task(
        gen, task, prompts, max_turns=max_turns, max_total_tokens=max_total_tokens, **sampling
    )
    return standalone_rows(gen, prompts, samples, SamplingParams(**sampling))
