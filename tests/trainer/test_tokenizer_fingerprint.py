"""The tokenizer fingerprint covers the chat template (trainer/models/tokenizer.py).

Two tokenizers with the same vocabulary but different chat templates render the same question
to different prompt ids, so their rollouts must not be mixed: their fingerprints differ. A
tokenizer without a template keeps the fingerprint it had before templates were included.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trainer.models.tiny import CHAT_TEMPLATE, make_tiny_model
from trainer.models.tokenizer import _normalise_merges, tokenizer_fingerprint

OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp") / "plain", num_layers=1, num_texts=200)


def _without_template(tok) -> str:
    """The fingerprint as computed before chat templates were part of it."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    payload = {
        "model_type": model.get("type"),
        "vocab": sorted(model["vocab"].items(), key=lambda kv: (kv[1], kv[0])),
        "merges": _normalise_merges(model.get("merges", [])),
        "added_tokens": sorted(
            ([t["id"], t["content"], bool(t.get("special"))] for t in spec["added_tokens"]),
            key=lambda t: t[0],
        ),
        "special_tokens": {a: getattr(tok, a) for a in ("bos_token", "eos_token", "pad_token")},
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_chat_template_changes_the_fingerprint(plain: Path, tmp_path: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(plain))
    assert not tok.chat_template
    base = tokenizer_fingerprint(tok)
    assert base == _without_template(tok)  # no template: the fingerprint stored rows carry

    tok.chat_template = CHAT_TEMPLATE
    chat = tokenizer_fingerprint(tok)
    tok.chat_template = OTHER_TEMPLATE
    other = tokenizer_fingerprint(tok)
    assert len({base, chat, other}) == 3

    # Saved and loaded (chat_template.jinja), through either loader: the same fingerprint.
    tok.save_pretrained(tmp_path / "other")
    assert tokenizer_fingerprint(tmp_path / "other") == other
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tmp_path / "other"))) == other
    # Named templates (a dict) count too, independent of their order.
    tok.chat_template = {"default": CHAT_TEMPLATE, "tool_use": OTHER_TEMPLATE}
    named = tokenizer_fingerprint(tok)
    tok.chat_template = {"tool_use": OTHER_TEMPLATE, "default": CHAT_TEMPLATE}
    assert tokenizer_fingerprint(tok) == named and named not in {base, chat, other}


def test_tiny_models_with_and_without_a_template(plain: Path, tmp_path: Path) -> None:
    chat = make_tiny_model(tmp_path / "chat", num_layers=1, num_texts=200, chat_template=True)
    meta = json.loads((chat / "tiny_model.json").read_text())
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(chat)
    # The vocabulary is trained on different (rendered) texts here, so compare like with like:
    # the chat model's tokenizer with its template removed is a third fingerprint.
    tok = PreTrainedTokenizerFast.from_pretrained(str(chat))
    with_template = tokenizer_fingerprint(tok)
    tok.chat_template = None
    assert tokenizer_fingerprint(tok) == _without_template(tok) != with_template
    assert tokenizer_fingerprint(plain) != with_template
