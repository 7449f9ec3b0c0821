"""The trainer's row transformer for ``rolloutstore-train ingest --from verl|trl|openai``.

rolloutstore maps another framework's rows to text rows and groups them
(:mod:`rolloutstore.interop`); this module turns text into token ids with the
tokenizer (chat messages, or text prompts with ``--chat-template``, are rendered with
its chat template, the one path of :mod:`trainer.tasks.chat`) and recomputes the
behaviour log-probs teacher-forced with the model (:mod:`trainer.rollout.scoring`: checked
model and tokenizer, batched, equal to :func:`trainer.rollout.hf.teacher_forced_logprobs`
under the sampling settings given), recorded as ``logprobs_mode = "recomputed"``.
Group advantages come from :func:`trainer.algo.advantage.group_advantages`.

The recomputed log-probs are those of the scoring model, not of the sampler: they are
exact behaviour log-probs only when ``--score-with`` holds the weights that sampled.

A multi-turn chat (``completion_messages``: every message from the first assistant turn on)
becomes one trajectory row (schema v2). The whole conversation is rendered with the chat
template, and the token boundary before each completion message comes from rendering the
conversation up to it: with ``add_generation_prompt=True`` before an assistant message (the
template's assistant header is then environment text, mask 0, and the assistant turn is what
the model generates, up to where the next message's rendering starts: its end-of-turn
marker included), without before any other. Each prefix's text must be a prefix of the whole
rendering and its token ids a prefix of the whole's token ids; a template that rewrites
earlier turns (e.g. drops past reasoning) or a tokenizer that merges tokens across a message
boundary breaks that, and the row is refused naming the message. ``loss_mask`` is 1 on the
assistant turns' tokens, 0 elsewhere; log-probs are recomputed for the whole completion and
kept on mask-1 tokens only (0.0 elsewhere: no log-prob on environment tokens).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer.algo.advantage import group_advantages
from trainer.rollout.scoring import ScoringConfig, ScoringModel
from trainer.tasks.base import Prompt
from trainer.tasks.chat import encode_prompt, render_prompts

LOGPROBS_MODE = "recomputed"


def _alternation(tokens: set[str]) -> re.Pattern:
    """One regex matching any of ``tokens``, longest first (as the tokenizer matches them)."""
    words = sorted(filter(None, tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words)) if words else "(?!)")


class TextRowTransformer:
    """Tokenizes and scores text rows; ``options`` is a ``rolloutstore.interop.TextImportOptions``.

    Every flag and folder is checked, and the tokenizer loaded, here; the model loads when the
    first rows are scored (:class:`~trainer.rollout.scoring.ScoringModel`), so a bad file or a
    refused store costs no model load. ``on_scored(n)``, when set (the ingest progress bar),
    is told after each scored batch of n rows.
    """

    def __init__(self, options: Any, scoring: ScoringConfig | None = None):
        from rolloutstore.errors import ValidationError

        self._error = ValidationError
        self.options = options
        if options.score_with is None:
            raise ValueError(
                f"ingest --from {options.source}: the file has no behaviour log-probs; pass "
                "--score-with MODEL_DIR to recompute them teacher-forced"
            )
        self.scorer = ScoringModel(options.score_with, options.tokenizer, scoring)
        self.tokenizer = self.scorer.tokenizer
        self.fingerprint = self.scorer.fingerprint
        self.on_scored: Callable[[int], None] | None = None
        import transformers

        self.generator = f"import:{options.source}/transformers/{transformers.__version__}"

    @property
    def model(self) -> Any:
        return self.scorer.model

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, mode: str) -> np.ndarray:
        return group_advantages(rewards, group_ids, mode=mode)

    # -- text never becomes control tokens ----------------------------------------------------
    # Two ways to keep imported text from turning into control tokens (<|im_end|>, EOS): refuse
    # text holding a control token's string, or render and then check that the ids' control
    # tokens sit exactly where the template put its own. The second needs the template's own
    # positions, which a template that branches on or trims content (Qwen3's <think> handling,
    # `content | trim`) makes unknowable short of re-implementing it; the first is exact, names
    # the field and the token, and costs one regex search per text. So: refuse (the importer
    # calls control_token_in on every text it reads, before anything is tokenized), tokenize
    # plain text with special-token parsing off anyway, and count a rendering's control tokens
    # against its text as a last check on the tokenizer.
    def _control_patterns(self) -> tuple[re.Pattern, re.Pattern | None, frozenset[int]]:
        if getattr(self, "_controls", None) is None:
            special = [t for t in self.tokenizer.added_tokens_decoder.values() if t.special]
            raw = {t.content for t in special if not t.normalized}
            raw |= set(self.tokenizer.all_special_tokens) - {t.content for t in special}
            normalized = {t.content for t in special if t.normalized}
            ids = self.tokenizer.convert_tokens_to_ids(sorted(raw | normalized))
            self._controls = (_alternation(raw), _alternation(normalized) if normalized else None,
                              frozenset(ids))  # fmt: skip
        return self._controls

    def control_token_in(self, text: str) -> str | None:
        """The first control (special) token string ``text`` holds, else None; tokens the
        tokenizer matches after normalization are looked for in the normalized text."""
        raw, normalized, _ = self._control_patterns()
        m = raw.search(text)
        if m is None and normalized is not None:
            norm = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "normalizer", None)
            m = normalized.search(norm.normalize_str(text) if norm is not None else text)
        return None if m is None else m.group(0)

    def _encode_text(self, text: str, special: bool) -> list[int]:
        """Ids of user text, special-token parsing off: a control token's string stays text."""
        ids = self.tokenizer(text, add_special_tokens=special, split_special_tokens=True)
        return list(ids["input_ids"])

    def _encode_rendered(self, text: str, i: int) -> list[int]:
        """Ids of a chat-template rendering (control tokens parsed: the template's own), checked
        to hold as many control tokens as the text has control-token strings (plus what the
        tokenizer itself adds, e.g. BOS, when the text does not start with it): content was
        refused if it held any."""
        ids = encode_prompt(self.tokenizer, text)
        raw, normalized, control = self._control_patterns()
        found = sum(1 for t in ids if t in control)
        want = len(raw.findall(text)) + (len(normalized.findall(text)) if normalized else 0)
        bos = getattr(self.tokenizer, "bos_token", None)
        if not (isinstance(bos, str) and bos and text.startswith(bos)):  # as encode_prompt adds
            want += self._added_count()
        if found != want:
            raise self._error(
                f"the chat template's rendering tokenizes to {found} control tokens where its "
                f"text holds {want}: text would have become control tokens",
                row=i,
                field="messages",
            )
        return ids

    def _added_count(self) -> int:
        """How many tokens (BOS, ...) the tokenizer adds around a text of its own accord."""
        if getattr(self, "_added", None) is None:
            self._added = len(self.tokenizer("", add_special_tokens=True)["input_ids"])
        return self._added

    def _prompt_ids(self, row: dict[str, Any], i: int) -> tuple[str, list[int]]:
        messages = row.pop("prompt_messages", None)
        text = row.pop("prompt", None)
        if messages is None and not self.options.chat_template:
            return text, self._encode_text(text, True)
        prompt = Prompt(text or "", "", messages=tuple(messages) if messages else None)
        try:
            (rendered,) = render_prompts(self.tokenizer, [prompt], True)
        except Exception as exc:  # no template, or one that cannot render these turns
            raise self._error(f"cannot render the prompt with the chat template: {exc}", row=i,
                              field="prompt") from exc  # fmt: skip
        return rendered.prompt_text, self._encode_rendered(rendered.prompt_text, i)

    def _render(self, messages: list[dict], generation_prompt: bool, i: int) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=generation_prompt,
                tokenize=False,
            )  # fmt: skip
        except Exception as exc:  # no template, or one that cannot render these turns
            raise self._error(f"cannot render the conversation with the chat template: {exc}",
                              row=i, field="messages") from exc  # fmt: skip

    def _trajectory(self, row: dict[str, Any], i: int) -> dict[str, Any]:
        """A multi-turn chat's prompt, completion ids, loss mask and turns (module docstring)."""
        prompt = row.pop("prompt_messages")
        done = row.pop("completion_messages")
        row.pop("prompt", None)
        prompt_text = self._render(prompt, True, i)
        full = self._render(prompt + done, False, i)
        full_ids = self._encode_rendered(full, i)
        prompt_ids = self._encode_rendered(prompt_text, i)
        bounds = [0]
        for j in range(1, len(done) + 1):
            if j == len(done):
                text, ids = full, full_ids
            else:
                text = self._render(prompt + done[:j], done[j]["role"] == "assistant", i)
                ids = self._encode_rendered(text, i)
            bound = len(ids) - len(prompt_ids)
            if not full.startswith(text) or full_ids[: len(ids)] != ids or bound < bounds[-1]:
                raise self._error(
                    f"cannot place the token boundary before completion message {j}: the chat "
                    "template's rendering up to it is not a prefix of the whole conversation's "
                    "(text or token ids); import such chats as single-turn rows instead",
                    row=i,
                    field="messages",
                )  # fmt: skip
            bounds.append(bound)
        if full_ids[: len(prompt_ids)] != prompt_ids or not full.startswith(prompt_text):
            raise self._error("the rendered prompt is not a prefix of the whole conversation",
                              row=i, field="messages")  # fmt: skip
        turns = [
            {"role": m["role"], "start": a, "end": b,
             "tool_name": m.get("name") if m["role"] == "tool" else None}
            for m, a, b in zip(done, bounds, bounds[1:])
        ]  # fmt: skip
        mask = [0] * (len(full_ids) - len(prompt_ids))
        for t in turns:
            if t["role"] == "assistant":
                mask[t["start"] : t["end"]] = [1] * (t["end"] - t["start"])
        return {
            "prompt_text": prompt_text,
            "completion_text": full[len(prompt_text) :],
            "prompt_ids": prompt_ids,
            "completion_ids": full_ids[len(prompt_ids) :],
            "loss_mask": mask,
            "turns": turns,
        }

    def _single(self, row: dict[str, Any], i: int) -> dict[str, Any]:
        prompt_text, prompt_ids = self._prompt_ids(row, i)
        completion = row.pop("completion")
        completion_ids = self._encode_text(completion, False)
        if not prompt_ids:  # a text prompt that is empty (and no BOS token to stand for it)
            raise self._error("empty prompt: the first completion token needs context",
                              row=i, field="prompt")  # fmt: skip
        return {
            "prompt_text": prompt_text,
            "completion_text": completion,
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
        }

    def __call__(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        o = self.options
        out, tokens_of = [], []
        for i, row in enumerate(rows):  # every row tokenized and checked before any is scored
            row = dict(row)
            tokens = (
                self._trajectory(row, i) if row.get("completion_messages") else self._single(row, i)
            )
            if not tokens["completion_ids"]:
                raise self._error(
                    "empty completion: nothing to train on", row=i, field="completion"
                )
            why = self.scorer.check_row(tokens["prompt_ids"], tokens["completion_ids"])
            if why is not None:
                raise self._error(why, row=i, field="completion")
            out.append(row)
            tokens_of.append(tokens)
        pairs = [(t["prompt_ids"], t["completion_ids"]) for t in tokens_of]
        scored = self.scorer.logprobs(pairs, o.temperature, o.top_p, o.top_k, self.on_scored)
        for row, tokens, lp in zip(out, tokens_of, scored):
            if "loss_mask" in tokens:  # no log-prob on environment tokens
                keep = torch.tensor(tokens["loss_mask"], dtype=torch.bool)
                lp = torch.where(keep, lp, torch.zeros((), dtype=lp.dtype))
            row.update(tokens)
            row.update(
                behavior_logprobs=lp.tolist(),
                logprobs_mode=LOGPROBS_MODE,
                tokenizer_fingerprint=self.fingerprint,
                temperature=o.temperature,
                top_p=o.top_p,
                top_k=o.top_k,
                generator=self.generator,
            )
        return out
