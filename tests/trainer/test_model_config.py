"""[model] and [generation] engine keys: validation naming [section].key, the device and dtype
rules, and what the loaders do with them."""

from __future__ import annotations

import pytest
import torch

from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.models.load import (
    check_model,
    load_model,
    resolve_device,
    resolve_dtype,
)
from trainer.rollout.sampling import GenerationConfig


@pytest.mark.parametrize(
    "section, values, needle",
    [
        ("model", {"dtype": "fp8"}, "[model].dtype = 'fp8'"),
        ("model", {"device": "gpu"}, "[model].device = 'gpu'"),
        ("model", {"device": "cuda:x"}, "[model].device"),
        ("model", {"attn_implementation": "flash"}, "[model].attn_implementation"),
        ("model", {"gradient_checkpointing": "yes"}, "[model].gradient_checkpointing"),
        ("model", {"trust_remote_code": 1}, "[model].trust_remote_code"),
        ("generation", {"dtype": "half"}, "[generation].dtype"),
        ("generation", {"gpu_memory_utilization": 1.5}, "[generation].gpu_memory_utilization"),
        ("generation", {"kv_cache_gib": -1}, "[generation].kv_cache_gib"),
        ("generation", {"tensor_parallel_size": 0}, "[generation].tensor_parallel_size"),
        ("generation", {"enforce_eager": "no"}, "[generation].enforce_eager"),
        ("generation", {"max_model_len": -2}, "[generation].max_model_len"),
        ("generation", {"max_model_len": 16, "max_tokens": 16}, "[generation].max_model_len"),
    ],
)
def test_bad_values_name_the_key(section, values, needle):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict({section: values})
    assert needle in str(exc.value)


def test_generation_dtype_defaults_to_the_learners():
    cfg = TrainConfig.from_dict({"model": {"dtype": "bfloat16"}})
    assert cfg.generation.dtype == "bfloat16"
    assert cfg.generation.engine_options()["dtype"] == "bfloat16"
    explicit = TrainConfig.from_dict(
        {"model": {"dtype": "bfloat16"}, "generation": {"dtype": "float32"}}
    )
    assert explicit.generation.dtype == "float32"
    assert TrainConfig.from_dict({}).generation.dtype == "auto"
    # The resolved value round-trips (run.json) to the same config.
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_engine_options_reach_vllm_names():
    opts = GenerationConfig(
        max_model_len=1024, gpu_memory_utilization=0.3, kv_cache_gib=2, tensor_parallel_size=2,
        enforce_eager=True,
    ).engine_options()  # fmt: skip
    assert opts == {
        "max_model_len": 1024, "gpu_memory_utilization": 0.3, "kv_cache_gib": 2.0,
        "tensor_parallel_size": 2, "dtype": "auto", "enforce_eager": True,
    }  # fmt: skip
    auto = GenerationConfig().engine_options()
    assert auto["max_model_len"] is auto["gpu_memory_utilization"] is auto["kv_cache_gib"] is None


def test_auto_rules_on_this_machine():
    cuda = torch.cuda.is_available()
    device = resolve_device("auto")
    assert device.type == ("cuda" if cuda else "cpu")
    assert resolve_dtype("auto", device) == (torch.bfloat16 if cuda else torch.float32)
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_what_the_device_cannot_do_is_refused():
    with pytest.raises(ConfigError, match=r'\[model\].dtype = "float16" is not supported on CPU'):
        resolve_dtype("float16", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"\[model\].device = \"cuda\" but this machine"):
            resolve_device("cuda")
        with pytest.raises(ConfigError, match="flash_attention_2"):
            check_model(
                TrainConfig.from_dict({"model": {"attn_implementation": "flash_attention_2"}}).model
            )


def test_folder_without_tokenizer_is_refused(tmp_path):
    from trainer.errors import ModelError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = TrainConfig.from_dict({"model": {"path": str(tmp_path / "m")}})
    with pytest.raises(ModelError, match=r"\[model\].path .* has no tokenizer"):
        check_model(cfg.model)


def test_load_model_applies_attention_and_dtype(tmp_path):
    from trainer.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", num_layers=1, num_texts=50)
    model, _ = load_model(path, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load_model(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
