"""The learner's log-probs and gradients equal a straightforward reference on the same rows.

The learner scores tokens through the chunked LM head (trainer/algo/chunked_head.py), whose
backward takes a shortcut when the head is frozen (LoRA). Here both paths are compared with what
a user would write, ``log_softmax(model(ids, mask).logits / T).gather(ids)``: on a tiny model
(trained head and LoRA, padded rows, temperature 0.7) and on SmolLM2-135M with a few rows. The
values compared are those of :meth:`Learner.sequence_logprobs` (pi_old in PPO epochs) and the
gradients those of the learner's own forward (``Learner._logprobs``) for a fixed functional.
"""

from __future__ import annotations

import pytest
import torch
from helpers import require_peft

from trainer.algo.learner import Learner
from trainer.algo.loss import LossConfig
from trainer.algo.optim import OptimConfig
from trainer.models.load import load_model
from trainer.models.lora import LoraSettings, apply_lora
from trainer.models.tiny import make_tiny_model


def _batch(vocab: int, lengths: list[int], temperature: float, seed: int) -> dict:
    """A right-padded batch in the loader's layout (the keys the learner's forward reads)."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, :length] = torch.randint(0, vocab, (length,), generator=g)
        mask[i, :length] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "temperature": torch.full((n,), temperature),
        "top_k": torch.zeros(n, dtype=torch.long),
        "top_p": torch.ones(n),
        "weights": torch.ones(n),
    }


def _reference(model, batch: dict, temperature: float) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def _compare(model, batch: dict, temperature: float, atol: float) -> None:
    learner = Learner(model, LossConfig(loss_type="ppo"), OptimConfig(lr=1e-3))
    valid = batch["attention_mask"][:, 1:].bool()
    ref = _reference(learner.model, batch, temperature)
    got = learner.sequence_logprobs(batch)
    assert got.shape == ref.shape
    torch.testing.assert_close(got[valid], ref[valid].detach(), rtol=0, atol=atol)

    params = [p for p in learner.model.parameters() if p.requires_grad]
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)) * valid
    mine = learner._logprobs(learner.model, batch, entropy=True)[0]
    got_grads = torch.autograd.grad((mine * weights).sum(), params)
    ref_grads = torch.autograd.grad((ref * weights).sum(), params)
    scale = max(float(g.abs().max()) for g in ref_grads)
    assert scale > 0
    for a, b in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol * max(scale, 1.0))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", architecture="llama")


@pytest.mark.parametrize("lora", [False, True], ids=["trained-head", "lora-frozen-head"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tiny_model_matches_log_softmax_reference(tiny_dir, lora, temperature) -> None:
    model, _ = load_model(tiny_dir, attn_implementation="sdpa")
    if lora:
        require_peft()
        model = apply_lora(model, LoraSettings(rank=4, alpha=8.0), seed=0)
        # LoRA B starts at zero (no gradient reaches A): move it so both get one.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    batch = _batch(model.config.vocab_size, [23, 40, 9], temperature, seed=0)
    _compare(model, batch, temperature, atol=1e-5)


@pytest.mark.slow
def test_smollm2_matches_log_softmax_reference(smollm2_dir) -> None:
    require_peft()
    model, _ = load_model(smollm2_dir, attn_implementation="sdpa")
    model = apply_lora(model, LoraSettings(rank=4, alpha=8.0), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(len(name)))
    batch = _batch(model.config.vocab_size, [20, 33, 12], 0.7, seed=1)
    _compare(model, batch, 0.7, atol=2e-4)
