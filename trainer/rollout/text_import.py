"""The trainer's row transformer for ``rolloutstore ingest --from verl|trl|openai``.

rolloutstore maps another framework's rows to text rows and groups them
(:mod:`rolloutstore.interop`); this module turns text into token ids with the
tokenizer (chat messages, or text prompts with ``--chat-template``, are rendered with
its chat template, the one path of :mod:`trainer.tasks.chat`) and recomputes the
behaviour log-probs teacher-forced with the model (:func:`trainer.rollout.hf.teacher_forced_logprobs`
under the sampling settings given), recorded as ``logprobs_mode = "recomputed"``.
Group advantages come from :func:`trainer.algo.advantage.group_advantages`.

The recomputed log-probs are those of the scoring model, not of the sampler: they are
exact behaviour log-probs only when ``--score-with`` holds the weights that sampled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.algo.advantage import group_advantages
from trainer.models.tokenizer import tokenizer_fingerprint
from trainer.rollout.hf import teacher_forced_logprobs
from trainer.tasks.base import Prompt
from trainer.tasks.chat import encode_prompt, render_prompts

LOGPROBS_MODE = "recomputed"


class TextRowTransformer:
    """Tokenizes and scores text rows; ``options`` is a ``rolloutstore.interop.TextImportOptions``."""

    def __init__(self, options: Any):
        from rolloutstore.errors import ValidationError

        self._error = ValidationError
        self.options = options
        if options.score_with is None:
            raise ValueError(
                f"ingest --from {options.source}: the file has no behaviour log-probs; pass "
                "--score-with MODEL_DIR to recompute them teacher-forced"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok_dir = Path(options.tokenizer or options.score_with)
        model_dir = Path(options.score_with)
        for what, d in (("--tokenizer", tok_dir), ("--score-with", model_dir)):
            if not d.is_dir():
                raise FileNotFoundError(f"{what} {d}: no such folder")
        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), local_files_only=True, dtype=torch.float32
        ).eval()
        import transformers

        self.generator = f"import:{options.source}/transformers/{transformers.__version__}"

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, mode: str) -> np.ndarray:
        return group_advantages(rewards, group_ids, mode=mode)

    def _prompt_ids(self, row: dict[str, Any], i: int) -> tuple[str, list[int]]:
        messages = row.pop("prompt_messages", None)
        text = row.pop("prompt", None)
        if messages is None and not self.options.chat_template:
            return text, encode_prompt(self.tokenizer, text)
        prompt = Prompt(text or "", "", messages=tuple(messages) if messages else None)
        try:
            (rendered,) = render_prompts(self.tokenizer, [prompt], True)
        except Exception as exc:  # no template, or one that cannot render these turns
            raise self._error(f"cannot render the prompt with the chat template: {exc}", row=i,
                              field="prompt") from exc  # fmt: skip
        return rendered.prompt_text, encode_prompt(self.tokenizer, rendered.prompt_text)

    def __call__(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        o = self.options
        out = []
        for i, row in enumerate(rows):
            row = dict(row)
            prompt_text, prompt_ids = self._prompt_ids(row, i)
            completion = row.pop("completion")
            completion_ids = list(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
            if not completion_ids:
                raise self._error(
                    "empty completion: nothing to train on", row=i, field="completion"
                )
            with torch.no_grad():
                lp = teacher_forced_logprobs(
                    self.model, prompt_ids, completion_ids, o.temperature, o.top_p, o.top_k
                )
            row.update(
                prompt_text=prompt_text,
                completion_text=completion,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                behavior_logprobs=lp.tolist(),
                logprobs_mode=LOGPROBS_MODE,
                tokenizer_fingerprint=self.fingerprint,
                temperature=o.temperature,
                top_p=o.top_p,
                top_k=o.top_k,
                generator=self.generator,
            )
            out.append(row)
        return out
