"""Build a tiny, random-weight Qwen2 model and its byte-level BPE tokenizer entirely offline.

The model is for tests and smoke runs of generation/training plumbing (HF and vLLM backends):
it has the real Qwen2 architecture and a real tokenizer trained on the chosen task's own text,
but random weights, so it babbles. Everything is deterministic in ``seed``: the same arguments
give byte-identical ``tokenizer.json`` and ``model.safetensors``.

Python: ``make_tiny_model(tmp_path / "tiny", task="arith", seed=0)``.
CLI:    ``python tools/make_tiny_model.py PATH --task arith --seed 0``.

:func:`tokenizer_fingerprint` identifies a tokenizer by content (vocab, merges, special tokens,
chat template); rollouts are only reused across tokenizers that share a fingerprint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.models.tokenizer import patch_tokenizer_config, tokenizer_fingerprint

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# vLLM's CPU attention kernels only accept a few head sizes; 64 is the smallest common one.
REQUIRED_HEAD_DIM = 64
# unk is left out: byte-level BPE never emits it, and Qwen2Tokenizer invents a default one.
# The chat template of make_tiny_model(chat_template=True): ChatML-like turns in plain-text
# markers (no extra special tokens: the vocabulary stays the same; the fingerprint covers it).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _training_texts(
    task: str, seed: int, n: int, task_kwargs: Mapping[str, Any], chat_template: str | None
) -> list[str]:
    from trainer.tasks import get_task

    prompts = get_task(task, **dict(task_kwargs)).make_prompts(n, seed)
    render = None
    if chat_template is not None:
        import jinja2

        render = jinja2.Template(chat_template).render
    texts = []
    for p in prompts:
        prompt = p.prompt_text
        if render is not None:
            messages = p.messages or ({"role": "user", "content": p.prompt_text},)
            prompt = render(messages=messages, add_generation_prompt=True)
        # Both answer styles, so "<answer>" tags get merged tokens like the bare answers do.
        texts.append(f"{prompt} {p.answer}")
        texts.append(f"{prompt} <answer>{p.answer}</answer>")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` laid out exactly like Qwen2's.

    The normaliser, pre-tokeniser (Qwen2's split regex, then ByteLevel) and decoder are the ones
    ``transformers``' ``Qwen2Tokenizer`` rebuilds when ``AutoTokenizer`` (and so vLLM) loads a
    ``qwen2`` checkpoint; any other layout would tokenise differently depending on the loader.
    When the corpus runs out of merges below ``vocab_size``, reserved special tokens fill the
    rest so that every id the model can sample decodes (to nothing).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # The full byte alphabet keeps every string encodable, not just the training text.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    n_reserved = vocab_size - tok.get_vocab_size()
    if n_reserved > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(n_reserved)])
    return tok


def _validate(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> None:
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("vocab_size", vocab_size),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden_size % num_heads or hidden_size // num_heads != REQUIRED_HEAD_DIM:
        raise ValueError(
            f"head_dim = hidden_size / num_heads must be {REQUIRED_HEAD_DIM} (vLLM CPU kernels), "
            f"got hidden_size={hidden_size}, num_heads={num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if vocab_size < 258:
        raise ValueError(
            f"vocab_size must be >= 258 (256 bytes + 2 special tokens), got {vocab_size}"
        )


def make_tiny_model(
    path: str | Path,
    *,
    task: str = "arith",
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    num_texts: int = 4000,
    task_kwargs: Mapping[str, Any] | None = None,
    chat_template: bool | str = False,
    architecture: str = "qwen2",
) -> Path:
    """Write a tokenizer + random Qwen2ForCausalLM to ``path`` and return it.

    ``architecture``: qwen2 (default), qwen3, llama or mistral (trainer/models/archs.py); the
    tokenizer is the same in every case.

    The tokenizer is trained on ``num_texts`` prompts of ``task`` (built with ``task_kwargs``)
    drawn with ``seed``; the weights are initialised under ``torch.manual_seed(seed)`` without
    disturbing the caller's global RNG. ``chat_template``: ``True`` gives the tokenizer
    :data:`CHAT_TEMPLATE` (saved with it, like an instruct model's), a string gives that Jinja
    template, ``False`` none (the prompts of tokenizers without one are fed as plain text).
    """
    _validate(
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        vocab_size,
        intermediate_size,
        max_position_embeddings,
    )
    if num_texts < 1:
        raise ValueError(f"num_texts must be >= 1, got {num_texts}")
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.models.archs import ARCHITECTURES, model_config

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    # Draw the texts first so a bad task name fails before anything is written.
    template = _chat_template(chat_template)
    texts = _training_texts(task, seed, num_texts, task_kwargs or {}, template)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_tokenizer(out, texts, vocab_size, template, max_position_embeddings)

    config = model_config(
        architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)

    meta = {
        "task": task,
        "seed": seed,
        "chat_template": template is not None,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "tiny_model.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def _chat_template(chat_template: bool | str | None) -> str | None:
    """make_tiny_model's ``chat_template`` argument -> the Jinja template to save, or None."""
    if chat_template is True:
        return CHAT_TEMPLATE
    if chat_template is False or chat_template is None:
        return None
    if isinstance(chat_template, str) and chat_template:
        return chat_template
    raise ValueError(f"chat_template must be a bool or a Jinja string, got {chat_template!r}")


def _save_tokenizer(
    out: Path, texts: list[str], vocab_size: int, template: str | None, max_positions: int
) -> Any:
    """Train the tokenizer on ``texts`` and save it (with ``template``) to ``out``."""
    from transformers import PreTrainedTokenizerFast

    backend = train_tokenizer(texts, vocab_size=vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}"
        )
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    patch_tokenizer_config(out / "tokenizer_config.json", max_positions)
    return tokenizer
