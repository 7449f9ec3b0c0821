"""Tests for trainer.models.tiny and tools/make_tiny_model.py (all offline, built into tmp_path).

Run: .venv/bin/python -m pytest -q tests/trainer/test_tiny.py
"""

from __future__ import annotations

import hashlib
import json
import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trainer.models.tiny import EOS_TOKEN, PAD_TOKEN, make_tiny_model
from trainer.models.tokenizer import tokenizer_fingerprint
from trainer.tasks import get_task

REPO = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "arith0", task="arith", seed=0)


def test_same_seed_gives_identical_files(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", task="arith", seed=0)
    for name in ("tokenizer.json", "model.safetensors", "config.json", "tokenizer_config.json"):
        assert _sha(tiny / name) == _sha(again / name), name
    assert tokenizer_fingerprint(tiny) == tokenizer_fingerprint(again)


def test_different_seed_changes_weights(tiny: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "seed1", task="arith", seed=1)
    assert _sha(tiny / "model.safetensors") != _sha(other / "model.safetensors")
    # The fingerprint follows the tokenizer's content, not how it was produced.
    same_tokenizer = _sha(tiny / "tokenizer.json") == _sha(other / "tokenizer.json")
    assert (tokenizer_fingerprint(tiny) == tokenizer_fingerprint(other)) == same_tokenizer


def test_fingerprint_differs_across_tasks_and_vocab(tiny: Path, tmp_path: Path) -> None:
    countdown = make_tiny_model(tmp_path / "cd", task="countdown", seed=0, num_layers=1)
    small = make_tiny_model(tmp_path / "small", task="arith", seed=0, vocab_size=300, num_layers=1)
    fps = {tokenizer_fingerprint(p) for p in (tiny, countdown, small)}
    assert len(fps) == 3
    for fp in fps:
        assert len(fp) == 16 and int(fp, 16) >= 0


def test_fingerprint_is_loader_and_timestamp_independent(tiny: Path, tmp_path: Path) -> None:
    fast = PreTrainedTokenizerFast.from_pretrained(str(tiny))
    auto = AutoTokenizer.from_pretrained(str(tiny))
    fp = tokenizer_fingerprint(tiny)
    assert tokenizer_fingerprint(fast) == fp == tokenizer_fingerprint(auto)
    # Re-saving (new files, new mtimes) keeps the fingerprint; adding a token changes it.
    fast.save_pretrained(tmp_path / "resaved")
    assert tokenizer_fingerprint(tmp_path / "resaved") == fp
    fast.add_tokens(["<new>"])
    assert tokenizer_fingerprint(fast) != fp


def test_tokenizer_roundtrips_task_text_identically_across_loaders(tiny: Path) -> None:
    fast = PreTrainedTokenizerFast.from_pretrained(str(tiny))
    auto = AutoTokenizer.from_pretrained(str(tiny))
    assert fast.eos_token == auto.eos_token == EOS_TOKEN
    assert fast.pad_token == auto.pad_token == PAD_TOKEN
    assert len(fast) == len(auto) == 512
    texts = [
        p.prompt_text + " <answer>" + p.answer + "</answer>"
        for p in get_task("arith").make_prompts(20, 5)
    ]
    texts += ["Ünïcode and  spaces\n\nand 12345 digits", EOS_TOKEN]
    for text in texts:
        ids = fast(text)["input_ids"]
        assert ids == auto(text)["input_ids"]
        assert fast.decode(ids) == text
    # Task text compresses: whole words are single tokens.
    assert len(fast("Compute 1+2. Answer:")["input_ids"]) < len("Compute 1+2. Answer:") // 2


def test_model_config_and_forward(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["vocab_size"] == 512
    model = AutoModelForCausalLM.from_pretrained(str(tiny))
    assert model.dtype == torch.float32
    tok = PreTrainedTokenizerFast.from_pretrained(str(tiny))
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    ids = torch.tensor([tok("Compute 1+2. Answer:")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    meta = json.loads((tiny / "tiny_model.json").read_text())
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny)


def test_build_does_not_disturb_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path / "m", num_layers=1, num_texts=50)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 96}, "head_dim"),
        ({"hidden_size": 256, "num_heads": 2}, "head_dim"),
        ({"hidden_size": 192, "num_heads": 3, "num_kv_heads": 2}, "multiple of num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_invalid_shapes_are_rejected(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_unknown_task_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        make_tiny_model(tmp_path / "bad", task="poetry")
    assert not (tmp_path / "bad").exists()


def test_cli_builds_the_same_model(tiny: Path, tmp_path: Path, capsys) -> None:
    script = runpy.run_path(str(REPO / "tools" / "make_tiny_model.py"), run_name="cli_under_test")
    assert script["main"]([str(tmp_path / "cli"), "--task", "arith", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert _sha(tmp_path / "cli" / "model.safetensors") == _sha(tiny / "model.safetensors")
    with pytest.raises(SystemExit):
        script["main"]([str(tmp_path / "cli2"), "--hidden-size", "100"])
