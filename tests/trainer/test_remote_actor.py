"""Actors on other machines: weights published to and read from s3://, rollouts appended to an
s3:// store (a real S3-compatible server, moto, on 127.0.0.1; fixtures in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer.rollout.weights as C
from rolloutstore import RolloutStore
from rolloutstore.schema.ids import deterministic_uuid7
from trainer.config import ConfigError, TrainConfig
from trainer.models.load import load_model
from trainer.models.tiny import make_tiny_model
from trainer.rollout.hf import max_logprob_gap
from trainer.run.actor import run_actor

ROOT = Path(__file__).parents[2]
GROUP, PROMPTS, START_MS = 4, 6, 1_700_000_000_000
CONFIG = f"""
[model]
num_layers = 1
[task]
name = "arith"
options = {{ max_operands = 2, max_digits = 1, ops = ["+"] }}
[generation]
backend = "hf"
group_size = {GROUP}
max_tokens = 5
prompts_per_round = {PROMPTS}
batch_prompts = 3
[run]
dir = "RUN"
run_id = "remote-test"
mode = "async"
"""


def _config(tmp_path: Path, run_id: str = "remote-test") -> Path:
    path = tmp_path / "actor.toml"
    text = CONFIG.replace("RUN", str(tmp_path / "run")).replace("remote-test", run_id)
    path.write_text(text)
    return path


def _learner_publishes(tmp_path: Path, weights: str, options: dict, version: int):
    """What the async learner does at start: run.json, then the policy's weights."""
    make_tiny_model(tmp_path / "init", num_layers=1, hidden_size=128)
    model, _ = load_model(tmp_path / "init")
    torch.manual_seed(0)
    with torch.no_grad():  # trained weights differ from the initial ones
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cfg = TrainConfig.load(_config(tmp_path))
    meta = {"run_id": "remote-test", "start_ms": START_MS, "config": cfg.to_dict()}
    C.write_text(weights, "run.json", json.dumps(meta), options)
    C.publish_weights(weights, version, model, template=tmp_path / "init", storage_options=options)
    return model


def test_published_weights_on_s3_latest_fetch_and_keep(tmp_path, s3_bucket):
    uri, options = s3_bucket
    weights = f"{uri}/weights"
    assert C.latest_weights(weights, options) is None
    model = torch.nn.Linear(3, 2)
    for v in range(4):
        with torch.no_grad():
            model.bias.fill_(v)
        C.publish_weights(weights, v, model, keep=2, storage_options=options)
    version, folder = C.latest_weights(weights, options)
    assert (version, folder) == (3, f"{weights}/{C.VERSION_FMT.format(3)}")
    local = C.fetch_weights(folder, tmp_path / "cache", options)
    from safetensors.torch import load_file

    assert load_file(str(local / "model.safetensors"))["bias"].tolist() == [3.0, 3.0]
    fs, root = C.object_fs(weights, options)
    names = sorted(i.base_name for i in fs.get_file_info(C.pafs.FileSelector(root)))
    assert names == ["LATEST", C.VERSION_FMT.format(2), C.VERSION_FMT.format(3)]
    with pytest.raises(FileNotFoundError):  # pruned: the actor re-reads LATEST
        C.fetch_weights(f"{weights}/{C.VERSION_FMT.format(0)}", tmp_path / "cache", options)


def test_standalone_actor_generates_with_s3_weights_into_s3_store(tmp_path, s3_bucket):
    uri, options = s3_bucket
    weights, store_uri = f"{uri}/weights", f"{uri}/store"
    model = _learner_publishes(tmp_path, weights, options, version=3)
    cmd = [sys.executable, "-m", "trainer", "actor", str(_config(tmp_path))]
    cmd += ["--store", store_uri, "--learner-weights", weights, "--actor-id", "1"]
    cmd += ["--max-rounds", "1", "--state-dir", str(tmp_path / "state")]
    for k, v in options.items():
        cmd += ["--storage-option", f"{k}={v}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr

    store = RolloutStore.open(store_uri, create=False, storage_options=options)
    rows = store.sql("SELECT * FROM rollouts ORDER BY rollout_id").to_pylist()
    assert len(rows) == PROMPTS * GROUP
    assert {(r["policy_version"], r["run_id"], r["policy_id"]) for r in rows} == {
        (3, "remote-test", "remote-test")
    }
    # Ids come from the learner's run identity (run.json beside the weights): a restarted
    # or relocated actor regenerates the same ids, which the store then skips.
    first = deterministic_uuid7("remote-test/a1/r0/b0/0", START_MS)
    assert first in {r["rollout_id"] for r in rows}
    # Sampled by the published weights, not by the initial model.
    init, _ = load_model(tmp_path / "init")
    assert max_logprob_gap(model, rows) < 1e-4 < 1e-2 < max_logprob_gap(init, rows)
    assert json.loads((tmp_path / "state" / "a1.json").read_text()) == {"round": 1}


def test_standalone_actor_stops_when_the_learner_writes_stop(tmp_path, s3_bucket):
    uri, options = s3_bucket
    weights = f"{uri}/weights"
    cfg = TrainConfig.load(_config(tmp_path))
    C.write_text(weights, "run.json", json.dumps({"run_id": "remote-test", "start_ms": 1}), options)
    C.write_text(weights, "STOP", "", options)
    rounds = run_actor(
        cfg, 0, weights_dir=weights, store_uri=f"{uri}/store", storage_options=options
    )
    assert rounds == 0


def test_standalone_actor_refuses_another_runs_weights(tmp_path, s3_bucket):
    uri, options = s3_bucket
    weights = f"{uri}/weights"
    C.write_text(weights, "run.json", json.dumps({"run_id": "remote-test", "start_ms": 1}), options)
    cfg = TrainConfig.load(_config(tmp_path, run_id="other-run"))
    with pytest.raises(ConfigError, match="'other-run'.*'remote-test'"):
        run_actor(cfg, 0, weights_dir=weights, store_uri=f"{uri}/store", storage_options=options)
    with pytest.raises(ConfigError, match="--store URI and --learner-weights URI"):
        run_actor(cfg, 0, weights_dir=weights, storage_options=options)


def test_storage_options_from_the_environment(monkeypatch):
    from trainer.config import OPTIONS_ENV, storage_options_from_env

    monkeypatch.setenv(OPTIONS_ENV, '{"aws_region": "eu-west-1"}')
    assert storage_options_from_env() == {"aws_region": "eu-west-1"}
    for bad in ("aws_region=eu-west-1", '{"timeout": 30}'):
        monkeypatch.setenv(OPTIONS_ENV, bad)
        with pytest.raises(ConfigError, match=OPTIONS_ENV):
            storage_options_from_env()


def test_sync_run_with_its_store_on_s3(tmp_path, s3_bucket, monkeypatch):
    """`[run] store = "s3://..."`: generation appends, selection, loading and usage all go
    through the object store; nothing is written to RUN_DIR/store."""
    from trainer.config import OPTIONS_ENV
    from trainer.run.sync import train

    uri, options = s3_bucket
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(options))
    text = CONFIG.replace('mode = "async"', "steps = 4\nupdates_per_round = 2\nbatch_size = 8")
    text = text.replace("RUN", str(tmp_path / "run"))
    cfg = TrainConfig.from_dict(
        {
            **{k: v for k, v in _toml(text).items() if k != "run"},
            "run": {**_toml(text)["run"], "store": f"{uri}/store", "checkpoint_every": 2},
            "eval": {**_toml(text).get("eval", {}), "prompts": 0},
        }
    )
    result = train(cfg, progress=False)
    assert result.store == f"{uri}/store" and not (tmp_path / "run" / "store").exists()
    store = RolloutStore.open(result.store, storage_options=options, create=False)
    assert store.count() == 2 * PROMPTS * GROUP  # two rounds of 6 prompts x 4 samples
    steps = store.sql("SELECT DISTINCT learner_step FROM usage ORDER BY 1")["learner_step"]
    assert steps.to_pylist() == [0, 1, 2, 3]  # every learner step drew from the S3 store


def _toml(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)
