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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

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
