"""Random-init configs of the decoder architectures the trainer is tested on.

``make_tiny_model(..., architecture="llama")`` builds its model from :func:`model_config`; the
same small shapes (head_dim 64, which vLLM's CPU kernels accept) in each family, so the tests in
tests/trainer/test_architectures.py run every one through training and generation.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")


def model_config(
    architecture: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    eos_token_id: int,
    pad_token_id: int,
) -> Any:
    """A transformers config of ``architecture`` (one of ARCHITECTURES) with these shapes."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}"
        )
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="float32",
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    head_dim = hidden_size // num_heads
    if architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    if architecture == "qwen3":
        # Qwen3 defaults head_dim to 128 whatever the hidden size; QK-norm is part of it.
        return transformers.Qwen3Config(**common, head_dim=head_dim)
    if architecture == "llama":
        return transformers.LlamaConfig(**common, head_dim=head_dim)
    # Mistral: sliding-window attention off, so every backend attends the same way.
    return transformers.MistralConfig(**common, head_dim=head_dim, sliding_window=None)
