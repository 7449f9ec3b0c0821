"""Published weights of a run (trainer/rollout/weights.py): LoRA adapters instead of full copies,
the run's precision, retention; and the per-process settings a run starts with ([run] threads,
the vLLM CPU engine's cores, enforce_eager "auto"; trainer/rollout/vllm_env.py).

The vLLM side (an engine starting from an adapter folder's base and taking the merged weights in
place, verified; the engine log kept out of the terminal) is tests/trainer/test_vllm_chat.py.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import require_peft, resumable_run_toml
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from trainer.config import ConfigError, RunConfig, TrainConfig, cpu_count, process_threads
from trainer.models.load import load_model
from trainer.models.lora import LoraSettings, apply_lora, merged_state
from trainer.models.tiny import make_tiny_model
from trainer.rollout.weights import (
    Publisher,
    load_published_model,
    model_folder,
    pruned,
    publish_weights,
    read_published,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    require_peft()
    return make_tiny_model(
        tmp_path_factory.mktemp("pub") / "llama", architecture="llama", num_layers=1,
        num_texts=300,
    )  # fmt: skip


def _trained_lora(base: Path, seed: int = 1) -> torch.nn.Module:
    """A LoRA model whose adapters moved (lora_B drawn, as after training), in float32."""
    model, _ = load_model(base)
    model = apply_lora(model, LoraSettings(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def _dtypes(file: Path) -> set[torch.dtype]:
    with safe_open(str(file), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118


def test_a_lora_version_is_adapter_sized_and_round_trips(tmp_path, llama):
    model = _trained_lora(llama)
    folder = publish_weights(tmp_path / "w", 1, model, template=llama)
    full = sum(v.numel() * v.element_size() for v in merged_state(model).values())
    assert _bytes(folder) < 0.1 * full, (_bytes(folder), full)
    assert not (folder / "model.safetensors").exists()
    assert model_folder(folder) == llama.resolve()
    # base + adapter == the learner's merged weights, bit for bit in float32
    published, merged = read_published(folder), merged_state(model)
    assert published.keys() == merged.keys()
    assert all(torch.equal(published[k], merged[k]) for k in merged)
    # PEFT's own loader reads the folder: its logits are the learner's.
    from peft import PeftModel

    base, _ = load_model(llama)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        want = model(ids).logits
        got = peft_model(ids).logits
        loaded = load_published_model(folder)[0](ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(loaded, want, atol=1e-5, rtol=0)
    with torch.no_grad():  # PeftModel wrapped `base` in place: a fresh one
        plain = load_model(llama)[0].eval()(ids).logits
    assert want.sub(plain).abs().max() > 1e-3  # the adapters do move it


def test_version_0_of_a_lora_run_refers_to_the_base(tmp_path, llama):
    model, _ = load_model(llama)
    model = apply_lora(model, LoraSettings(rank=4, alpha=8), seed=0)  # lora_B = 0
    folder = publish_weights(tmp_path / "w", 0, model, template=llama)
    ref = json.loads((folder / "base.json").read_text())
    assert ref["base"] == str(llama.resolve()) and len(ref["fingerprint"]) == 64
    base = load_model(llama)[0].state_dict()
    assert all(torch.equal(v, base[k]) for k, v in read_published(folder).items())


def test_a_changed_base_is_refused_by_name(tmp_path, llama):
    base = tmp_path / "base"
    base.mkdir()
    for f in llama.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    folder = publish_weights(tmp_path / "w", 1, _trained_lora(base), template=base)
    state = load_model(base)[0].state_dict()
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(base / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        read_published(folder)


def test_weights_are_published_in_the_runs_precision(tmp_path, llama):
    plain, _ = load_model(llama)
    folder = publish_weights(tmp_path / "w", 1, plain, template=llama, dtype=torch.bfloat16)
    assert _dtypes(folder / "model.safetensors") == {torch.bfloat16}
    lora = publish_weights(tmp_path / "l", 1, _trained_lora(llama), template=llama,
                           dtype=torch.bfloat16)  # fmt: skip
    assert _dtypes(lora / "adapter_model.safetensors") == {torch.bfloat16}


def test_a_bfloat16_run_publishes_bfloat16_and_runs_on_its_threads(tmp_path, llama):
    """A whole sync run (transformers backend, [model].dtype bfloat16, [run] threads = 1)."""
    import trainer.run.sync as T

    text = resumable_run_toml("bf16", "batch_size = 8\ncheckpoint_every = 2\nthreads = 1\n")
    data = tomllib.loads(text.format(dir=tmp_path / "run", steps=2))
    data["model"].update(path=str(llama), device="cpu", dtype="bfloat16")
    before = torch.get_num_threads()
    try:
        T.train(TrainConfig.from_dict(data), progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    (folder,) = (tmp_path / "run" / "weights").glob("v-*")
    assert _dtypes(folder / "model.safetensors") == {torch.bfloat16}


def test_retention_keeps_the_newest_and_the_checkpoints_versions(tmp_path, llama):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-000000003"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 3, "policy_version": 3}))
    model, _ = load_model(llama)
    publisher = Publisher(run_dir, keep=2)
    for v in range(8):
        publisher.publish(run_dir / "weights", v, model, llama)
    names = sorted(p.name for p in (run_dir / "weights").glob("v-*"))
    assert names == ["v-000000003", "v-000000006", "v-000000007"]
    assert (run_dir / "weights" / "LATEST").read_text().strip() == "7"
    everything = Publisher(tmp_path / "all", keep=0)
    for v in range(4):
        everything.publish(tmp_path / "all" / "weights", v, model, llama)
    assert len(list((tmp_path / "all" / "weights").glob("v-*"))) == 4


@given(
    versions=st.sets(st.integers(0, 60), min_size=1, max_size=20),
    keep=st.integers(0, 6),
    protect=st.sets(st.integers(0, 60), max_size=4),
)
def test_pruning_removes_only_what_nothing_needs(versions, keep, protect):
    names = [f"v-{v:09d}" for v in versions]
    latest = max(versions)
    gone = {int(n[2:]) for n in pruned(names, keep, protect, latest)}
    kept = versions - gone
    assert gone <= versions and latest in kept and protect & versions <= kept
    # Exactly: the newest `keep`, the protected ones, LATEST; all of them with keep = 0.
    newest = set(sorted(versions)[-keep:]) if keep else versions
    assert kept == newest | (protect & versions) | {latest}


def test_threads_default_to_all_cores_in_sync_and_a_share_in_async(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    n = cpu_count()
    assert process_threads(RunConfig()) == n
    assert process_threads(RunConfig(mode="async", actors=1)) == max(1, n // 2)
    assert process_threads(RunConfig(threads=3)) == 3
    with pytest.raises(ConfigError, match=r"\[run\]: threads must be >= 0"):
        TrainConfig.from_dict({"run": {"threads": -1}})


def test_the_vllm_cpu_engine_gets_its_cores(monkeypatch):
    from trainer.rollout.vllm_env import cpu_env

    for key in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(key, raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_env(None) == cpu_env(len(cpus)) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if len(cpus) >= 2:  # two actors of one core each bind different cores
        one = cpu_env(1, slot=0)["VLLM_CPU_OMP_THREADS_BIND"]
        two = cpu_env(1, slot=1)["VLLM_CPU_OMP_THREADS_BIND"]
        assert one != two and {int(one), int(two)} <= set(cpus)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # the user's own setting wins
    assert cpu_env(None) == {}


def test_enforce_eager_is_auto_by_default_and_takes_true_false_auto():
    from trainer.rollout.sampling import GenerationConfig

    assert GenerationConfig().enforce_eager == "auto"
    for value in (True, False, "auto"):
        assert GenerationConfig(enforce_eager=value).engine_options()["enforce_eager"] == value
    with pytest.raises(ConfigError, match=r"\[generation\]\.enforce_eager"):
        TrainConfig.from_dict({"generation": {"enforce_eager": "sometimes"}})
    with pytest.raises(ConfigError, match=r"\[generation\]\.engine_log"):
        TrainConfig.from_dict({"generation": {"engine_log": "loud"}})


def test_a_busy_machine_gets_a_threads_hint_once(monkeypatch):
    import trainer.rollout.vllm_env as E

    monkeypatch.setattr(E, "_HINTED", [])
    all_cores = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    assert E.contention_hint(all_cores) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (cpu_count() + 4.0, 1.0, 1.0))
    assert E.contention_hint({"VLLM_CPU_OMP_THREADS_BIND": "0"}) is None  # a share: no hint
    hint = E.contention_hint(all_cores)
    assert hint is not None and "[run] threads" in hint
    assert E.contention_hint(all_cores) is None  # once per process
