"""The vLLM backend in the sync loop with chat-rendered prompts, a model folder with its own code
([model].trust_remote_code) and LoRA adapters: one engine start covers all three (and the
transformers backend runs the same folder, which without trust_remote_code is refused).

The model folder is a tiny Qwen2 with a chat template whose config.json names its own config
class (``auto_map``, model_type ``tiny_remote``): neither transformers nor vLLM read it without
``trust_remote_code``, so the run only works if the setting reaches the engine. The learner trains
LoRA adapters; the published versions are adapter folders referring to the base, the engine
starts from the base folder and takes each version in place, as merged weights. Checks: the
stored prompt ids are the tokenizer's ``apply_chat_template(..., add_generation_prompt=True)``
ids, and the behaviour log-probs equal the LoRA learner's at staleness 0, before and after the
in-place update. The run uses the defaults a user gets: the engine runs eagerly on CPU
(enforce_eager "auto"), binds every core (the sync learner waits meanwhile), and its start-up
output goes to RUN_DIR/engine.log, not to the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from helpers import ROOT, require_peft, require_vllm
from safetensors.torch import load_file

from rolloutstore import RolloutStore
from trainer.algo.logprobs import sequence_logprobs
from trainer.config import TrainConfig
from trainer.models.load import load_model
from trainer.models.lora import LoraSettings, apply_lora
from trainer.models.tiny import make_tiny_model

LORA = {"rank": 4, "alpha": 8}
CONFIG_PY = """from transformers import Qwen2Config


class TinyRemoteConfig(Qwen2Config):
    model_type = "tiny_remote"
"""
MODELING_PY = """from transformers import Qwen2ForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(Qwen2ForCausalLM):
    config_class = TinyRemoteConfig
"""


def remote_code_model(path: Path) -> Path:
    """A tiny chat model whose config class is the folder's own code (vLLM runs it as Qwen2)."""
    path = make_tiny_model(path, chat_template=True, num_layers=1, num_texts=300)
    (path / "configuration_tiny_remote.py").write_text(CONFIG_PY)
    (path / "modeling_tiny_remote.py").write_text(MODELING_PY)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "tiny_remote"
    cfg["auto_map"] = {
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return remote_code_model(tmp_path_factory.mktemp("vllm-chat") / "model")


RUN_TOML = """
[model]
path = "{model}"
device = "cpu"
trust_remote_code = true
[model.lora]
rank = 4
alpha = 8
[task]
name = "arith"
chat_template = true
[task.options]
max_operands = 2
max_digits = 1
ops = ["+"]
[generation]
backend = "vllm"
group_size = 4
max_tokens = 6
prompts_per_round = 4
[replay]
window = 64
seed = 1
[loss]
entropy_coef = 0.01
[optim]
lr = 1e-2
[run]
dir = "{run}"
steps = 4
updates_per_round = 2
batch_size = 8
checkpoint_every = 2
keep_checkpoints = 10
[eval]
prompts = 0
every = 0
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir) -> Path:
    """The run, as a user starts it (``python -m trainer train``, the defaults of
    [generation]: enforce_eager "auto", engine_log "quiet"); its terminal output is kept in
    terminal.txt beside the run folder."""
    require_vllm()
    require_peft()
    root = tmp_path_factory.mktemp("vllm-chat-run")
    run_dir = root / "run"
    (root / "run.toml").write_text(RUN_TOML.format(model=model_dir, run=run_dir))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "train", str(root / "run.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (root / "terminal.txt").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_dir


def _rows(run_dir: Path, version: int) -> list[dict]:
    rows = (
        RolloutStore.open(run_dir / "store", create=False)
        .sql(
            "SELECT prompt_text, prompt_ids, completion_ids, behavior_logprobs, temperature, "
            f"generator FROM rollouts WHERE policy_version = {version}"
        )
        .to_pylist()
    )
    assert rows and all(r["generator"].startswith("vllm/") for r in rows)
    return rows


def test_the_folder_needs_trust_remote_code(model_dir):
    with pytest.raises(ValueError, match="custom code"):
        load_model(model_dir)
    require_vllm()
    from trainer.rollout.vllm import VLLMGenerator

    with pytest.raises(ValueError, match="custom code"):  # refused before an engine starts
        VLLMGenerator(model_dir)


def test_without_trust_remote_code_the_run_is_refused_in_one_line(tmp_path, model_dir):
    from trainer.errors import ConfigError
    from trainer.run.sync import train

    cfg = TrainConfig.from_dict(
        {"model": {"path": str(model_dir)}, "run": {"dir": str(tmp_path / "run")}}
    )
    with pytest.raises(ConfigError, match=r"set \[model\].trust_remote_code = true"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()


def test_the_transformers_backend_runs_the_folder_with_trust_remote_code(tmp_path, model_dir):
    """The sync loop's transformers generator gets [model].trust_remote_code too."""
    from trainer.run.sync import train

    cfg = TrainConfig.from_dict(
        {
            "model": {"path": str(model_dir), "device": "cpu", "trust_remote_code": True},
            "task": {"name": "arith", "chat_template": True,
                     "options": {"max_operands": 2, "max_digits": 1, "ops": ["+"]}},
            "generation": {"backend": "hf", "group_size": 2, "max_tokens": 4,
                           "prompts_per_round": 4},
            "run": {"dir": str(tmp_path / "run"), "steps": 1, "batch_size": 8,
                    "checkpoint_every": 1},
            "eval": {"prompts": 2, "every": 0},
        }
    )  # fmt: skip
    assert train(cfg, progress=False).steps == 1
    rows = RolloutStore.open(tmp_path / "run" / "store", create=False).sql(
        "SELECT prompt_text, generator FROM rollouts"
    )
    assert rows.num_rows == 8
    assert all(g.startswith("transformers/") for g in rows["generator"].to_pylist())


def test_stored_prompt_ids_are_the_chat_template_ids(run, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    assert tok.chat_template
    for version in (0, 2):
        for r in _rows(run, version):
            question = r["prompt_text"].removeprefix("<|user|>\n").removesuffix("\n<|assistant|>\n")
            assert question != r["prompt_text"]
            messages = [{"role": "user", "content": question}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            assert r["prompt_ids"] == list(ids)
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert r["prompt_text"] == text


def _learner_model(model_dir: Path, run_dir: Path, step: int):
    """The LoRA learner's model at ``step`` (adapters unmerged, as the learner scores)."""
    model, _ = load_model(model_dir, trust_remote_code=True)
    model = apply_lora(model, LoraSettings(**LORA), seed=0)
    ckpt = run_dir / "checkpoints" / f"step-{step:09d}" / "model.safetensors"
    model.load_state_dict(load_file(str(ckpt)), strict=False)
    return model.eval()


def _gaps(model, rows: list[dict]) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            n = len(r["completion_ids"])
            lp = sequence_logprobs(model, ids, temperature=r["temperature"]).logprobs[0, -n:]
            out.append((lp - torch.tensor(r["behavior_logprobs"])).abs())
    return torch.cat(out)


def test_vllm_logprobs_match_the_lora_learner_at_staleness_0(run, model_dir):
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    weights = [r for r in records if r["kind"] == "weights"]
    # Version 0 started the engine from its published folder; version 2 went in place.
    assert [(w["policy_version"], w["engine_starts"], w["in_place_updates"]) for w in weights] == [
        (0, 1, 0),
        (2, 1, 1),
    ]
    base, _ = load_model(model_dir, trust_remote_code=True)
    for version in (0, 2):
        rows = _rows(run, version)
        gaps = _gaps(_learner_model(model_dir, run, version) if version else base, rows)
        print(f"vLLM (chat prompts, merged LoRA) vs learner, version {version}: max gap "
              f"{gaps.max():.2e} over {gaps.numel()} tokens")  # fmt: skip
        assert gaps.max() < 1e-4
    # The adapters moved by version 2: the base weights score its rows clearly differently.
    assert _gaps(base, _rows(run, 2)).max() > 1e-3


# Engine-start lines that read as errors but need no action (trainer/rollout/vllm_env.py).
NOISE = ("chunked prefill", "LD_PRELOAD", "Triton", "MEMBIND", "INFO")


def test_engine_output_goes_to_the_run_folder_not_the_terminal(run):
    terminal = (run.parent / "terminal.txt").read_text(errors="replace")
    log = (run / "engine.log").read_text(errors="replace")
    for needle in NOISE:
        assert needle not in terminal, needle
        assert needle in log, needle
    # enforce_eager "auto" is eager on CPU; the sync run's engine binds every core.
    assert "Enforce eager set" in log
    assert f"core ids={sorted(os.sched_getaffinity(0))}" in log


def test_lora_versions_are_published_as_adapters(run, model_dir):
    folders = sorted((run / "weights").glob("v-*"))
    assert folders
    base = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    for folder in folders:
        assert not (folder / "model.safetensors").exists()
        ref = json.loads((folder / "base.json").read_text())
        assert ref["base"] == str(model_dir.resolve())
        assert sum(f.stat().st_size for f in folder.iterdir()) < 0.25 * base
