"""rolloutstore-train refuses user errors with one line, exit code 2, and leaves nothing behind.

Each case runs the real CLI in a subprocess (``python -m trainer``) and checks stderr is a
single ``error: ...`` line naming the problem (no traceback), unless ``--debug`` asks for it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY_RUN_TOML, trainer_cli

from rolloutstore import RolloutStore


def _one_line_error(p: subprocess.Popen, *needles: str) -> str:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, (p.returncode, out[-2000:], err[-3000:])
    # The error is one line, the last; before it only progress output (model building).
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:], err[-3000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _config(tmp_path, extra: str = "", model: str | None = None) -> str:
    text = TINY_RUN_TOML.format() + extra
    text += f'\n[run]\ndir = "{tmp_path / "run"}"\nsteps = 2\nwarm_start_steps = 0\n'
    if model is not None:
        text = text.replace("[model]\n", f'[model]\npath = "{model}"\n', 1)
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return str(path)


def test_missing_model_folder_is_one_line_and_creates_no_run(tmp_path):
    cfg = _config(tmp_path, model=str(tmp_path / "no-such-model"))
    _one_line_error(trainer_cli("train", cfg), "[model].path", "no-such-model")
    assert not (tmp_path / "run").exists()  # nothing half-made


def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "weights-only").mkdir()
    cfg = _config(tmp_path, model=str(tmp_path / "weights-only"))
    _one_line_error(trainer_cli("train", cfg), "config.json")
    assert not (tmp_path / "run").exists()


def test_resume_of_a_folder_with_no_run(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(trainer_cli("resume", str(tmp_path / "empty")), "no run to resume")


def test_bad_config_key_and_debug_shows_the_traceback(tmp_path):
    cfg = _config(tmp_path, extra="\n[loss]\nno_such_key = 1\n")
    _one_line_error(trainer_cli("train", cfg), "[loss].no_such_key")
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "--debug", "train", cfg, "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0 and "Traceback" in p.stderr and "ConfigError" in p.stderr


def test_source_store_with_another_embedding_dimension(tmp_path):
    RolloutStore.open(tmp_path / "other", embedding_dim=32)
    RolloutStore.open(tmp_path / "run" / "store", embedding_dim=64)
    cfg = _config(tmp_path)
    path = Path(cfg)
    path.write_text(
        path.read_text().replace("[run]\n", f'[run]\nsources = ["{tmp_path / "other"}"]\n')
    )
    _one_line_error(trainer_cli("train", cfg), "32-dimensional", "64")


def test_buffer_exhausted_mid_run_is_one_line_naming_the_fix(tmp_path):
    # One round of 6 prompts x 4 = 24 rows every 10 steps, each row usable once, 24 per
    # batch: step 2 finds the buffer empty.
    cfg = _config(tmp_path)
    path = Path(cfg)
    text = path.read_text().replace("max_uses = 3", "max_uses = 1")
    text = text.replace("steps = 2\n", "steps = 4\nbatch_size = 24\nupdates_per_round = 10\n")
    path.write_text(text)
    _one_line_error(
        trainer_cli("train", cfg), "learner step 2", "no eligible rows", "replay.max_uses"
    )


def test_model_folder_without_tokenizer(tmp_path):
    (tmp_path / "no-tok").mkdir()
    (tmp_path / "no-tok" / "config.json").write_text("{}")
    cfg = _config(tmp_path, model=str(tmp_path / "no-tok"))
    _one_line_error(trainer_cli("train", cfg), "[model].path", "no tokenizer", "save_pretrained")
    assert not (tmp_path / "run").exists()


def test_dtype_the_device_cannot_run(tmp_path):
    cfg = _config(tmp_path)
    path = Path(cfg)
    path.write_text(
        path.read_text().replace("[model]\n", '[model]\ndevice = "cpu"\ndtype = "float16"\n', 1)
    )
    _one_line_error(trainer_cli("train", cfg), "[model].dtype", "CPU", "bfloat16")
    assert not (tmp_path / "run").exists()


def test_cuda_requested_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    cfg = _config(tmp_path)
    path = Path(cfg)
    path.write_text(path.read_text().replace("[model]\n", '[model]\ndevice = "cuda"\n', 1))
    _one_line_error(trainer_cli("train", cfg), "[model].device", "no CUDA", '"auto"')
    assert not (tmp_path / "run").exists()


def _task_config(tmp_path, task: str) -> str:
    cfg = Path(_config(tmp_path))
    text = cfg.read_text()
    start = text.index("[task]\n")
    end = text.index("[generation]")
    cfg.write_text(text[:start] + task + text[end:])
    return str(cfg)


def test_dataset_task_without_a_path_is_one_line_and_creates_no_run(tmp_path):
    cfg = _task_config(tmp_path, '[task]\nname = "dataset"\noptions = { reward = "exact" }\n')
    _one_line_error(trainer_cli("train", cfg), "[task].options.path", "required", "dataset")
    assert not (tmp_path / "run").exists()
    missing = tmp_path / "questoins.jsonl"
    cfg = _task_config(tmp_path, f'[task]\nname = "dataset"\noptions = {{ path = "{missing}" }}\n')
    _one_line_error(trainer_cli("train", cfg), "[task].options", "questoins.jsonl", "no such file")
    assert not (tmp_path / "run").exists()


def test_task_options_without_a_task_name_name_the_key(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = _task_config(tmp_path, f'[task]\noptions = {{ path = "{tmp_path / "q.jsonl"}" }}\n')
    _one_line_error(trainer_cli("train", cfg), "[task].options.path", '[task].name = "dataset"')
    assert not (tmp_path / "run").exists()


def test_a_source_that_is_no_store_is_refused_before_the_run_folder_exists(tmp_path):
    cfg = Path(_config(tmp_path))
    missing = tmp_path / "no-such-run"
    cfg.write_text(cfg.read_text().replace("[run]\n", f'[run]\nsources = ["{missing}"]\n'))
    _one_line_error(trainer_cli("train", str(cfg)), "[run].sources", "no-such-run")
    assert not (tmp_path / "run").exists()


def test_tiny_model_replaying_a_run_of_a_model_folder_names_model_path(tmp_path):
    # [model].path unset means the tiny model (intended); a source made with a real model
    # cannot share its tokenizer: say which key to set, before anything is created.
    src = tmp_path / "earlier"
    RolloutStore.open(src / "store")
    (src / "run.json").write_text('{"config": {"model": {"path": "/models/Qwen"}}}')
    cfg = Path(_config(tmp_path))
    cfg.write_text(cfg.read_text().replace("[run]\n", f'[run]\nsources = ["{src}"]\n'))
    _one_line_error(trainer_cli("train", str(cfg)), "[model].path", "/models/Qwen", '"tiny"')
    assert not (tmp_path / "run").exists()


def test_a_failed_setup_removes_the_fresh_run_folder(tmp_path, monkeypatch):
    import tomllib

    import trainer.run.sync as T
    from trainer.config import TrainConfig

    def fail(*_a, **_k):
        raise OSError("disk gone")

    monkeypatch.setattr(T, "setup_learner", fail)
    cfg = TrainConfig.from_dict(tomllib.loads(Path(_config(tmp_path)).read_text()))
    with pytest.raises(OSError, match="disk gone"):
        T.train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    # A run folder that was there before the start stays.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("x")
    with pytest.raises(OSError, match="disk gone"):
        T.train(cfg, progress=False)
    assert (tmp_path / "run" / "keep.txt").exists()


@pytest.mark.parametrize("flag", ["--score-with", "--tokenizer"])
def test_a_misspelled_score_with_folder_is_one_line_naming_the_flag(tmp_path, flag):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2", "reward": 1}\n')
    args = ["ingest", str(tmp_path / "store"), str(tmp_path / "rows.jsonl"), "--from", "trl"]
    if flag == "--score-with":
        args += ["--score-with", str(tmp_path / "modle")]
    else:  # a real model folder, a misspelled tokenizer folder
        from trainer.models.tiny import make_tiny_model

        make_tiny_model(tmp_path / "model", task="arith", seed=0, num_layers=1)
        args += ["--score-with", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok")]
    _one_line_error(trainer_cli(*args), flag, "no such folder")
    assert not (tmp_path / "store").exists()


def test_generate_with_a_misspelled_model_folder_creates_no_store(tmp_path):
    store = tmp_path / "gen"
    p = trainer_cli("generate", str(store), "--model", str(tmp_path / "modle"), "--task", "arith")
    _one_line_error(p, "--model", "modle", "no such folder", '"tiny"')
    assert not store.exists()
