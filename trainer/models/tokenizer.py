"""Tokenizer fingerprints: rollouts are reused only across tokenizers that share one.

A fingerprint covers what decides a rollout's token ids: the vocabulary, the merges, the added
and special tokens, and the chat template (it renders the prompt text before tokenisation, so two
templates give different ``prompt_ids`` for the same question). A tokenizer without a chat template
keeps the fingerprint it had before templates were included; rows that a tokenizer *with* one
stored before then carry its old fingerprint, and ``[run] sources`` refuses to mix them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_SPECIAL_ATTRS = ("bos_token", "eos_token", "pad_token")


def patch_tokenizer_config(path: Path, model_max_length: int) -> None:
    # transformers 5 writes its own "TokenizersBackend" class, which 4.x (e.g. a vLLM pin)
    # cannot resolve; PreTrainedTokenizerFast loads tokenizer.json verbatim in both.
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = model_max_length
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _normalise_merges(merges: list[Any]) -> list[list[str]]:
    # tokenizers < 0.20 serialises merges as "a b" strings, newer versions as ["a", "b"].
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]


def tokenizer_fingerprint(tokenizer_or_path: Any, *, chat_template: bool = True) -> str:
    """First 16 hex chars of a sha256 over the tokenizer's vocab, merges, special tokens and
    chat template (when it has one; ``chat_template=False`` leaves it out: the fingerprint of
    the vocabulary alone, which decides what each id means to a model).

    Accepts a ``PreTrainedTokenizerFast`` (or any HF fast tokenizer), a raw
    ``tokenizers.Tokenizer``, or a directory holding ``tokenizer.json`` (loaded locally only).
    """
    tok = tokenizer_or_path
    if isinstance(tok, (str, Path)):
        from transformers import PreTrainedTokenizerFast

        p = Path(tok)
        if not (p / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {p}")
        tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)

    specials: dict[str, Any] = {}
    template = None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        for attr in _SPECIAL_ATTRS:
            specials[attr] = getattr(tok, attr, None)
        template = _chat_template(tok) if chat_template else None
    elif hasattr(tok, "to_str"):
        backend = tok
    else:
        raise ValueError(
            f"cannot fingerprint {type(tokenizer_or_path).__name__}; pass a fast tokenizer, "
            "a tokenizers.Tokenizer or a directory with tokenizer.json"
        )

    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    vocab = model.get("vocab", {})
    vocab_items = (
        sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])) if isinstance(vocab, dict) else vocab
    )
    added = sorted(
        ([t["id"], t["content"], bool(t.get("special"))] for t in spec.get("added_tokens", [])),
        key=lambda t: t[0],
    )
    payload = {
        "model_type": model.get("type"),
        "vocab": vocab_items,
        "merges": _normalise_merges(model.get("merges", [])),
        "added_tokens": added,
        "special_tokens": specials,
    }
    if template is not None:  # absent, not null: template-less fingerprints stay as they were
        payload["chat_template"] = template
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _chat_template(tok: Any) -> str | list[list[str]] | None:
    """The tokenizer's chat template: its text, named templates as sorted (name, text) pairs,
    or None when it has none."""
    template = getattr(tok, "chat_template", None)
    if not template:
        return None
    if isinstance(template, dict):
        return [[str(k), str(v)] for k, v in sorted(template.items())]
    return str(template)
