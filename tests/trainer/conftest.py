"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.models.tiny import make_tiny_model

# ChatML, as SmolLM2 / Qwen write it: the turn markers are special tokens.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory) -> Path:
    """A 1-layer tiny model whose chat turns are marked by special tokens: two of its
    reserved special tokens renamed <|im_start|> and <|im_end|>, a ChatML template (same
    vocabulary, so the weights fit)."""
    path = tmp_path_factory.mktemp("chatml") / "model"
    make_tiny_model(path, num_layers=1, num_texts=300, chat_template=CHATML)
    spec = json.loads((path / "tokenizer.json").read_text())
    names = {"<|reserved_0|>": "<|im_start|>", "<|reserved_1|>": "<|im_end|>"}
    for t in spec["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path
