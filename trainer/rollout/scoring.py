"""Teacher-forced scoring of imported text rollouts: the model and tokenizer of
``rolloutstore-train ingest --from ... --score-with MODEL_DIR [--tokenizer DIR]``, checked
before anything heavy loads, and batched log-prob computation.

Checks (each a one-line :class:`~trainer.errors.ModelError` naming the flag and the fix):
the folders exist and are folders; the model folder has a config.json; the tokenizer loads and
encodes text; ``--tokenizer`` is the model's own (same vocabulary fingerprint as the model
folder's tokenizer, when it has one: another vocabulary would score ids the model never saw);
every id the tokenizer can give is inside the model's embedding table. Rows are checked before
any is scored: token ids inside the vocabulary, prompt + completion within the model's context.

Why batching: on CPU a 1-layer model spends most of a one-row forward in per-op dispatch and
thread wake-ups, not arithmetic (tools/bench_ingest.py measures it), so rows are scored in
padded batches. Rows are sorted by length and packed while ``rows x longest <= batch_tokens``
(little padding, bounded memory). Padding goes on the right, with an attention mask: a causal
model's real tokens never attend to later (pad) positions and keep positions 0..n-1, so each
row's log-probs are those of its own unpadded forward (left padding would shift positions).
The log-probs come from :func:`trainer.algo.logprobs.sequence_logprobs`, the learner's own
computation, so ingest and training agree on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rolloutstore.options import help_field
from trainer.errors import ModelError

# Encoded to check a tokenizer loads as one (a folder with tokenizer_config.json but no
# vocabulary file loads as a tokenizer that encodes everything to nothing).
_PROBE = "Hello, world 1+2=3"


@dataclass(frozen=True)
class ScoringConfig:
    """How ``ingest --from`` runs the scoring model (the ``--score-*`` flags)."""

    batch_tokens: int = help_field(
        "padded tokens per scoring forward (rows x longest row in a batch); lower it when "
        "memory runs short, 1 scores row by row",
        8192,
    )

    def __post_init__(self) -> None:
        if isinstance(self.batch_tokens, bool) or self.batch_tokens < 1:
            raise ValueError(f"--score-batch-tokens must be >= 1, got {self.batch_tokens!r}")


def _folder(path: str | Path, flag: str, what: str) -> Path:
    p = Path(path)
    if p.is_file():
        raise ModelError(f"{flag} {str(p)!r} is a file, not a folder: give the {what} folder "
                         f"(the one save_pretrained wrote, e.g. {str(p.parent)!r})")  # fmt: skip
    if not p.is_dir():
        raise ModelError(f"{flag} {str(p)!r}: no such folder; give the {what} folder")
    return p


def _load_tokenizer(path: Path, flag: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken folder
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"{flag} {str(path)!r}: the tokenizer does not load ({first}); give a "
                         "folder that tokenizer.save_pretrained wrote") from exc  # fmt: skip
    if not tok(_PROBE, add_special_tokens=False)["input_ids"]:
        raise ModelError(
            f"{flag} {str(path)!r}: its tokenizer files load as a tokenizer without a vocabulary "
            "(text encodes to no ids; tokenizer.json / vocab files missing?): save the whole "
            "tokenizer there (tokenizer.save_pretrained) or pass --tokenizer DIR"
        )
    return tok


def _has_tokenizer_files(path: Path) -> bool:
    from trainer.models.load import TOKENIZER_FILES

    return any((path / f).is_file() for f in TOKENIZER_FILES)


class ScoringModel:
    """The checked tokenizer and (loaded on first use) model of ``--score-with``."""

    def __init__(
        self, score_with: str | Path, tokenizer: str | Path | None = None,
        config: ScoringConfig | None = None,
    ):  # fmt: skip
        from transformers import AutoConfig

        from trainer.models.tokenizer import tokenizer_fingerprint

        self.config = config or ScoringConfig()
        self.model_dir = _folder(score_with, "--score-with", "model")
        if not (self.model_dir / "config.json").is_file():
            raise ModelError(f"--score-with {str(self.model_dir)!r} has no config.json: give the "
                             "folder that save_pretrained wrote (weights, config.json)")  # fmt: skip
        own = None
        if tokenizer is None:
            if not _has_tokenizer_files(self.model_dir):
                raise ModelError(
                    f"--score-with {str(self.model_dir)!r} has no tokenizer files: pass "
                    "--tokenizer DIR (the model's tokenizer), or save it into the model folder"
                )
            own = self.tokenizer = _load_tokenizer(self.model_dir, "--score-with")
            self.tokenizer_flag = "--score-with"
        else:
            tok_dir = _folder(tokenizer, "--tokenizer", "tokenizer")
            self.tokenizer = _load_tokenizer(tok_dir, "--tokenizer")
            self.tokenizer_flag = "--tokenizer"
            if _has_tokenizer_files(self.model_dir):
                own = _load_tokenizer(self.model_dir, "--score-with")
        if own is not None and own is not self.tokenizer:
            # The chat template is left out: it changes how prompts render (the stored
            # fingerprint has it), not which ids mean what to the model.
            mine = tokenizer_fingerprint(own, chat_template=False)
            given = tokenizer_fingerprint(self.tokenizer, chat_template=False)
            if mine != given:
                raise ModelError(
                    f"--tokenizer {str(tokenizer)!r} is not the tokenizer of --score-with "
                    f"{str(self.model_dir)!r} (vocabulary fingerprint {given} vs {mine}): its "
                    "ids would be scored by a model that never used them; drop --tokenizer, or "
                    "give the model's own tokenizer (its chat template may differ)"
                )
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        cfg = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        self.vocab_size = int(cfg.vocab_size)
        self.context = getattr(cfg, "max_position_embeddings", None)
        top = max(self.tokenizer.get_vocab().values()) + 1
        if top > self.vocab_size:
            raise ModelError(
                f"{self.tokenizer_flag} {str(tokenizer or self.model_dir)!r}: the tokenizer's "
                f"ids go up to {top - 1}, the model of --score-with has {self.vocab_size} "
                "embeddings: it is not this model's tokenizer; give the model's own"
            )
        self._model = None

    @property
    def model(self) -> Any:
        """The model, in float32 for evaluation (loaded on first use: every check first)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                str(self.model_dir), local_files_only=True, dtype=torch.float32
            ).eval()
        return self._model

    def check_row(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> str | None:
        """Why this row cannot be scored (a reason naming its length), or None."""
        n = len(prompt_ids) + len(completion_ids)
        if self.context is not None and n > self.context:
            return (f"prompt + completion is {n:,} tokens, longer than the scoring model's "
                    f"context ({self.context:,} max_position_embeddings): drop or shorten the "
                    "row")  # fmt: skip
        return None

    def logprobs(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        on_scored: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """Each (prompt ids, completion ids) pair's completion log-probs, batched."""
        return batched_logprobs(
            self.model, pairs, temperature, top_p, top_k,
            batch_tokens=self.config.batch_tokens, on_scored=on_scored,
        )  # fmt: skip


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Row indices in batches of similar length with ``rows x longest <= batch_tokens`` (a
    longer row alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:  # ascending: the newest row is the batch's longest
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.no_grad()
def batched_logprobs(
    model: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    *,
    batch_tokens: int = 8192,
    on_scored: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Completion log-probs (float32, one per completion token) of each (prompt, completion)
    pair under the processed sampling distribution: what
    :func:`trainer.rollout.hf.teacher_forced_logprobs` gives row by row, in right-padded
    batches (module docstring). ``on_scored(n)`` is called after each batch of n rows."""
    from trainer.algo.logprobs import sequence_logprobs
    from trainer.rollout.sampling import check_processing

    check_processing(temperature, top_p, top_k)
    if any(not p or not c for p, c in pairs):
        raise ValueError("every pair needs a non-empty prompt and completion")
    device = next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in pairs]
    out: list[torch.Tensor | None] = [None] * len(pairs)
    for batch in length_batches(lengths, batch_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T); pad id 0, masked
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, : lengths[i]] = torch.tensor([*pairs[i][0], *pairs[i][1]], dtype=torch.long)
            mask[b, : lengths[i]] = 1
        lp = sequence_logprobs(
            model,
            ids.to(device),
            attention_mask=mask.to(device),
            temperature=temperature,
            top_k=top_k or None,
            top_p=top_p if top_p < 1.0 else None,
        ).logprobs  # (B, T-1): column t is the log-prob of token t + 1
        for b, i in enumerate(batch):
            start = len(pairs[i][0]) - 1
            out[i] = lp[b, start : start + len(pairs[i][1])].float().cpu()
        if on_scored is not None:
            on_scored(len(batch))
    return out  # type: ignore[return-value]
