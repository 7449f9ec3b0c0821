"""In-place vLLM weight updates (trainer.rollout.vllm_update): the engine samples from the new weights.

One engine per module (about 20-40 s on 2 CPU cores). After each update, vLLM's sampled-token
log-probs are compared with a teacher-forced transformers recomputation of the new weights
(must agree) and of the previous ones (must not), including a prompt longer than a KV-cache
block, so that reusing cached blocks of the old weights would show. A corrupted transfer is
injected behind the verifier's back and must be refused.
Run: .venv/bin/python -m pytest -q tests/trainer/test_vllm_update.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import require_vllm

import trainer.rollout.vllm_update as vllm_update
from trainer.models.load import load_model
from trainer.models.tiny import make_tiny_model
from trainer.rollout.hf import max_logprob_gap
from trainer.rollout.vllm_update import WeightUpdateError
from trainer.rollout.weights import publish_weights

TOLERANCE = 1e-3  # what the actors accept
DIFFERENT = 0.05  # a gap this large means "other weights" (matching ones agree to ~1e-6)
# Over 256 tokens: spans several KV-cache blocks (128 tokens on CPU), so the prefix cache
# would serve keys/values of the old weights after an update if it were not reset.
LONG = "Compute " + "+".join(str(i % 10) for i in range(160)) + ". Answer:"
PROMPTS = ["Compute 1+2. Answer:", "Compute 3+4. Answer:", LONG]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllmupd") / "tiny", task="arith", seed=0)


@pytest.fixture(scope="module")
def gen(tiny: Path):
    require_vllm()
    from trainer.rollout.vllm import VLLMGenerator

    with VLLMGenerator(tiny, policy_version=0, seed=0, enforce_eager=True) as g:
        yield g


def _model(tiny: Path, state: dict[str, torch.Tensor]):
    model, _ = load_model(tiny)
    model.load_state_dict(state)
    return model.eval()


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _sample(gen) -> list[dict]:
    return gen.generate(PROMPTS, group_size=2, temperature=0.9, top_p=0.95, max_tokens=12, seed=3)


def _gaps(rows, *models) -> list[float]:
    return [max_logprob_gap(m, rows) for m in models]


def test_long_prompt_spans_several_kv_blocks(gen) -> None:
    assert len(gen.tokenizer(LONG)["input_ids"]) > 256


def test_update_from_state_dict_samples_the_new_weights(gen, tiny) -> None:
    old = _model(tiny, load_model(tiny)[0].state_dict())
    before = _sample(gen)  # also fills the prefix cache with blocks of the old weights
    assert _gaps(before, old)[0] < TOLERANCE
    new_state = _perturbed(old.state_dict(), seed=1)
    new = _model(tiny, new_state)

    result = gen.update_weights(new_state, policy_version=1)
    assert result.policy_version == 1 and result.gap < TOLERANCE
    rows = _sample(gen)
    new_gap, old_gap = _gaps(rows, new, old)
    assert new_gap < TOLERANCE
    assert old_gap > DIFFERENT
    # The long prompt (several cached blocks) is sampled from the new weights too.
    assert _gaps([r for r in rows if r["prompt_text"] == LONG], new)[0] < TOLERANCE
    assert {r["policy_version"] for r in rows} == {1}


def test_several_updates_in_a_row_from_dicts_and_folders(gen, tiny, tmp_path) -> None:
    state = load_model(tiny)[0].state_dict()
    previous = None
    for version in range(2, 6):
        state = _perturbed(state, seed=version)
        model = _model(tiny, state)
        if version % 2:  # odd versions through a published folder, as async actors do
            folder = publish_weights(tmp_path / "weights", version, model, template=tiny)
            gen.update_weights(folder, policy_version=version)
        else:
            gen.update_weights(state, policy_version=version)
        rows = _sample(gen)
        assert _gaps(rows, model)[0] < TOLERANCE, version
        if previous is not None:
            assert _gaps(rows, previous)[0] > DIFFERENT, version
        assert {r["policy_version"] for r in rows} == {version}
        previous = model


def test_corrupted_update_is_refused_until_a_good_one(gen, tiny, monkeypatch) -> None:
    good = _perturbed(load_model(tiny)[0].state_dict(), seed=11)
    real = vllm_update.update_weights

    def corrupting(llm, weights):  # injected fault: one tensor changes on its way to vLLM
        name = "model.layers.1.mlp.down_proj.weight"
        bad = dict(weights)
        bad[name] = bad[name] + 0.5 * torch.randn_like(bad[name])
        return real(llm, bad)

    monkeypatch.setattr(vllm_update, "update_weights", corrupting)
    version = gen.policy_version
    with pytest.raises(WeightUpdateError, match="refusing to generate"):
        gen.update_weights(good, policy_version=version + 1)
    assert gen.policy_version == version
    with pytest.raises(WeightUpdateError, match="refusing"):
        gen.generate(PROMPTS, group_size=1)

    monkeypatch.setattr(vllm_update, "update_weights", real)
    gen.update_weights(good, policy_version=version + 1)
    assert _gaps(_sample(gen), _model(tiny, good))[0] < TOLERANCE


def test_weights_that_do_not_fit_are_rejected_before_the_engine_changes(gen, tiny) -> None:
    state = _perturbed(load_model(tiny)[0].state_dict(), seed=21)
    gen.update_weights(state, policy_version=30)
    missing = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        gen.update_weights(missing, policy_version=31)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        gen.update_weights(tiny / "no-such-folder", policy_version=31)
    assert gen.policy_version == 30
    assert _gaps(_sample(gen), _model(tiny, state))[0] < TOLERANCE


def test_low_level_update_reads_a_published_folder_in_the_worker(gen, tiny, tmp_path) -> None:
    model = _model(tiny, _perturbed(load_model(tiny)[0].state_dict(), seed=41))
    folder = publish_weights(tmp_path / "weights", 41, model, template=tiny)
    assert vllm_update.update_weights(gen._llm, folder) == len(model.state_dict())
    assert _gaps(_sample(gen), model)[0] < TOLERANCE


def test_reload_warning_of_buffer_only_layers_is_dropped_and_no_other() -> None:
    """vLLM's layerwise reload warns "<Layer>: Failed to load weights" for rotary embeddings
    (computed caches, nothing in any checkpoint) on every update; the worker extension installs
    a filter on that logger that drops the line for buffer-only layers and keeps it for any
    layer with weights. (The worker logs in its own process, so this checks vLLM's logger and
    the filter in this one; records are handed to the logger's filters directly, so other
    tests' logging set-up cannot hide them.)"""
    import logging

    require_vllm()
    from vllm.logger import init_logger

    log = init_logger(vllm_update._RELOAD_LOGGER)

    def record(layer: str) -> logging.LogRecord:
        return log.makeRecord(
            log.name, logging.WARNING, __file__, 0, "%s: Failed to load weights", (layer,), None
        )

    vllm_update._quiet_buffer_only_layers()
    vllm_update._quiet_buffer_only_layers()  # idempotent: one filter
    assert log.filters.count(vllm_update._not_a_buffer_only_layer) == 1
    assert not log.filter(record("RotaryEmbedding"))
    assert log.filter(record("QKVParallelLinear"))
    other = log.makeRecord(log.name, logging.WARNING, __file__, 0, "something else", (), None)
    assert log.filter(other)
