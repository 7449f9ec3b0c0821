"""How a task's prompts reach a model: plain text, or rendered with the tokenizer's chat template.

One path for every backend and for evaluation: :func:`render_prompts` turns task prompts into
the text the model sees (``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)`` when the chat template is on), and :func:`encode_prompt` turns that text into
the prompt token ids (the transformers and vLLM generators both call it), so the store records
the rendered text and its ids whichever backend sampled. The setting is ``[task]
chat_template``: ``true``, ``false`` or ``"auto"`` (on when the tokenizer has a template)::

    from trainer.tasks.chat import render_prompts
    rendered = render_prompts(tokenizer, task.make_prompts(8, seed=0), task.chat_template)
    gen.generate([p.prompt_text for p in rendered], group_size=4)

:func:`fit_prompts` holds the rendered prompts to the model's context before anything is
sampled (``[generation] prompt_overflow``): a prompt whose tokens + ``max_tokens`` exceed it is
refused (``"error"``), cut from the left (``"truncate_left"``, plain-text prompts only) or left
out and counted (``"skip"``). Both generators refuse such a prompt too (:func:`check_fits`), so
a caller that skips this step gets the error, never a silently overlong context.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rolloutstore.schema.ids import prompt_id_of
from trainer.errors import TaskError
from trainer.tasks.base import Prompt

CHAT_MODES = (True, False, "auto")


def check_chat_mode(mode: object) -> None:
    """Refuse anything but ``True``, ``False`` or ``"auto"``."""
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in CHAT_MODES):
        raise ValueError(f'chat_template must be true, false or "auto", got {mode!r}')


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (``None`` tokenizers have none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer: Any, mode: bool | str) -> bool:
    """Resolve ``mode`` for ``tokenizer``; ``True`` without a template is an error."""
    check_chat_mode(mode)
    if mode == "auto":
        return has_chat_template(tokenizer)
    if mode and not has_chat_template(tokenizer):
        raise TaskError(
            "[task] chat_template = true, but the model's tokenizer has no chat template: use "
            "an instruct model (its tokenizer_config.json or chat_template.jinja has one), set "
            'tokenizer.chat_template and save it, or set chat_template = false (or "auto")'
        )
    return bool(mode)


def render_prompts(tokenizer: Any, prompts: Sequence[Prompt], mode: bool | str) -> list[Prompt]:
    """``prompts`` with ``prompt_text`` set to what the model sees.

    With the chat template on, each prompt's ``messages`` (or its text as one user turn) are
    rendered with ``add_generation_prompt=True``; with it off, text prompts pass unchanged and
    a ``messages`` prompt is an error (its turns have no plain-text form the user chose).
    """
    chat = uses_chat_template(tokenizer, mode)
    out = []
    for k, p in enumerate(prompts):
        if not chat:
            if p.messages is not None:
                raise TaskError(
                    f"prompt {k} is a list of chat messages, but chat templates are off "
                    f"(chat_template = {mode!r}"
                    + (", and the tokenizer has none" if mode == "auto" else "")
                    + "): use a tokenizer with a chat template, or plain-text prompts "
                    "(prompt_field instead of messages_field)"
                )
            out.append(p)
            continue
        messages = p.messages or ({"role": "user", "content": p.prompt_text},)
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str) or not text:
            raise TaskError(f"prompt {k}: the chat template rendered {text!r}, expected text")
        out.append(replace(p, prompt_text=text, messages=tuple(messages)))
    return out


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt token ids of ``text``, the same for every backend.

    A chat template usually writes the BOS token itself; adding the tokenizer's own special
    tokens again would start the prompt with two. Text that already begins with the BOS token
    is therefore encoded as is; other text gets the tokenizer's usual special tokens.
    """
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


class PromptTooLongError(TaskError):
    """A prompt whose tokens + ``max_tokens`` exceed the model's context."""


class PromptOverflowWarning(UserWarning):
    """Prompts were cut or left out under ``[generation] prompt_overflow``."""


def check_fits(prompt_ids: Sequence[Sequence[int]], max_tokens: int, limit: int | None) -> None:
    """Refuse the first of ``prompt_ids`` whose length + ``max_tokens`` exceeds ``limit``
    (None: no known limit): the generators' last check, whatever called them."""
    if limit is None:
        return
    for k, ids in enumerate(prompt_ids):
        if len(ids) + max_tokens > limit:
            raise PromptTooLongError(_too_long(k, list(ids), max_tokens, limit))


def _too_long(k: int, ids: list[int], max_tokens: int, limit: int) -> str:
    return (
        f"prompt {k} (prompt_id {prompt_id_of(ids)}) is {len(ids)} tokens; with max_tokens "
        f"{max_tokens} it needs {len(ids) + max_tokens} positions, the model's context is "
        f"{limit}: shorten the prompt, lower [generation].max_tokens, or set "
        '[generation].prompt_overflow = "skip" (or "truncate_left" for plain-text prompts)'
    )


@dataclass(frozen=True)
class FittedPrompts:
    """:func:`fit_prompts`' result: the prompts to generate from (in order), and the indices
    (into the prompts given) it cut from the left and left out."""

    prompts: list[Prompt]
    truncated: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def fit_prompts(
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int,
    limit: int | None,
    policy: str,
    record: str = "generate record",
) -> FittedPrompts:
    """Hold rendered ``prompts`` to ``limit`` positions (prompt + ``max_tokens``) by ``policy``.

    ``"error"``: :class:`PromptTooLongError` naming the first prompt too long. ``"skip"``: such
    prompts are left out. ``"truncate_left"``: each is cut to its longest suffix of text that
    fits, so what it asks (at its end) survives; a chat-rendered prompt is refused under it,
    overlong or not, because a left cut removes the system prompt, the BOS and the turn
    headers the template wrote. A cut or left-out prompt warns (:class:`PromptOverflowWarning`),
    naming the metrics ``record`` that counts it (generation's, or the eval's).
    """
    if policy not in ("error", "truncate_left", "skip"):
        raise ValueError(f'policy must be "error", "truncate_left" or "skip", got {policy!r}')
    if policy == "truncate_left":
        for k, p in enumerate(prompts):
            if p.messages is not None:
                raise TaskError(
                    f'[generation].prompt_overflow = "truncate_left" cuts plain-text prompts '
                    f"only, and prompt {k} is chat-rendered (a cut from the left would drop the "
                    "system prompt and turn headers the chat template wrote): use "
                    '"skip" or "error", or [task].chat_template = false'
                )
    if limit is None:
        return FittedPrompts(list(prompts))
    budget = limit - max_tokens
    kept: list[Prompt] = []
    truncated: list[int] = []
    skipped: list[int] = []
    for k, p in enumerate(prompts):
        ids = encode_prompt(tokenizer, p.prompt_text)
        if len(ids) <= budget:
            kept.append(p)
        elif policy == "error":
            raise PromptTooLongError(_too_long(k, ids, max_tokens, limit))
        elif policy == "skip":
            skipped.append(k)
        else:
            kept.append(replace(p, prompt_text=_left_cut(tokenizer, p.prompt_text, budget, k)))
            truncated.append(k)
    if skipped or truncated:
        what, which = ("left out", skipped) if skipped else ("cut from the left", truncated)
        warnings.warn(
            f"{len(which)} of {len(prompts)} prompts were {what} ([generation].prompt_overflow "
            f'= "{policy}"; first: prompt {which[0]}): each needs more than the model\'s '
            f"{limit} positions with max_tokens {max_tokens}; the {record} counts them",
            PromptOverflowWarning,
            stacklevel=2,
        )
    return FittedPrompts(kept, truncated, skipped)


def _left_cut(tokenizer: Any, text: str, budget: int, k: int) -> str:
    """The longest suffix ``text[c:]`` that encodes to at most ``budget`` tokens.

    The generators encode the text the store records, so the cut is made in text and
    checked by encoding it (a decode of the last ``budget`` ids need not encode back to
    them). Token counts grow with the suffix, so a binary search over ``c`` takes O(log n)
    encodes; only a suffix that was encoded and fits is returned.
    """
    lo, hi = 0, len(text)  # text[len(text):] is empty: it fits, or nothing does
    while lo < hi:
        mid = (lo + hi) // 2
        if len(encode_prompt(tokenizer, text[mid:])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    if hi == len(text):
        raise PromptTooLongError(
            f"prompt {k}: no part of it fits the {budget} positions the model's context leaves "
            "beside max_tokens: lower [generation].max_tokens"
        )
    return text[hi:]
