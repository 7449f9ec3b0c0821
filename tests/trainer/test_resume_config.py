"""A resume with a changed config: [optim] / [model] keys apply or are refused, run.json
records each resume, and resume names the checkpoint it continued from (issue 26, item 4).

A 4-step tiny run (checkpoints at steps 2 and 4, a cosine schedule over 6 steps) is copied
and resumed. A resume with no change is bit for bit the uninterrupted run:
test_resume_exact.py and test_checkpoint_integrity.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tomllib

import pytest
from helpers import resumable_run_toml, trainer_cli, with_eval

import trainer.run.checkpoint as C
import trainer.run.sync as T
from rolloutstore import RolloutStore
from trainer.algo.optim import OptimConfig
from trainer.config import ModelConfig, TrainConfig
from trainer.errors import ConfigError, RunDirError
from trainer.models.lora import LoraSettings
from trainer.run.resume import APPLIED, REFUSED, check_resume

STEPS = 4
RUN = with_eval(
    resumable_run_toml(
        "resume-config",
        """
updates_per_round = 2
batch_size = 8
checkpoint_every = 2
warm_start_steps = 1
""",
    ),
    every=0,
)
OPTIM = {"warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 6, "min_lr_ratio": 0.1}
LR, NEW_LR = 1e-3, 3e-3


def _config(run_dir, **optim) -> TrainConfig:
    data = tomllib.loads(RUN.format(dir=run_dir, steps=STEPS))
    data["optim"].update(OPTIM, **optim)
    return TrainConfig.from_dict(data)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    T.train(_config(run_dir), progress=False)
    return run_dir


@pytest.fixture
def run(tmp_path, trained):
    """A copy of the trained run (its run.json still names the original folder)."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _train_lrs(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["lr"] for r in map(json.loads, lines) if r["kind"] == "train"}


def _ckpt(run_dir, step: int):
    return run_dir / "checkpoints" / C.STEP_FMT.format(step)


def _resume_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("resumed ")]


def test_changed_lr_applies_to_adamw_and_the_schedule(run, capsys):
    cfg = _config(run, lr=NEW_LR, weight_decay=0.1).with_run(steps=6)
    capsys.readouterr()
    T.train(cfg, resume=True, progress=False)
    # Steps 5 and 6 use the new peak lr at the schedule's step: no step at the old lr after.
    new, old = cfg.optim, _config(run).optim
    lrs = _train_lrs(run)
    assert [lrs[s] for s in (1, 2, 3, 4)] == [LR * old.lr_factor(k) for k in range(4)]
    assert [lrs[s] for s in (5, 6)] == [NEW_LR * new.lr_factor(k) for k in (4, 5)]
    learner = C.read_checkpoint(_ckpt(run, 6)).trainer_state["learner"]
    assert learner["scheduler"]["base_lrs"] == [NEW_LR, NEW_LR]
    groups = learner["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [NEW_LR * new.lr_factor(6)] * 2
    assert [g["initial_lr"] for g in groups] == [NEW_LR] * 2
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # matrices only, as at the start
    meta = json.loads((run / "run.json").read_text())
    assert meta["config"]["optim"]["lr"] == LR  # the config the run started with
    (entry,) = meta["resumes"]
    assert entry["step"] == 4 and entry["checkpoint"] == str(_ckpt(run, 4))
    assert entry["changed"] == {
        "optim.lr": [LR, NEW_LR], "optim.weight_decay": [0.0, 0.1], "run.steps": [4, 6]
    }  # fmt: skip
    assert entry["config"]["optim"]["lr"] == NEW_LR
    assert TrainConfig.from_dict(entry["config"]) == cfg
    (line,) = _resume_lines(capsys.readouterr().out)
    assert "optim.lr 0.001 -> 0.003" in line


def test_resume_names_its_checkpoint_and_the_next_resume_keeps_the_changes(run):
    p = trainer_cli("resume", str(run), "--set", f"optim.lr={NEW_LR}", "--set", "run.steps=5")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert _resume_lines(out) == [
        f"resumed from checkpoint {_ckpt(run, 4)} (step 4); "
        "changed optim.lr 0.001 -> 0.003, run.steps 4 -> 5"
    ]
    # A plain resume continues with the config the run last ran with, not the first one.
    p = trainer_cli("resume", str(run), "--set", "run.steps=6")
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert _resume_lines(out) == [
        f"resumed from checkpoint {_ckpt(run, 5)} (step 5); changed run.steps 5 -> 6"
    ]
    new = _config(run, lr=NEW_LR).optim
    assert _train_lrs(run)[6] == NEW_LR * new.lr_factor(5)
    resumes = json.loads((run / "run.json").read_text())["resumes"]
    assert [(r["step"], r["config"]["optim"]["lr"]) for r in resumes] == [(4, NEW_LR), (5, NEW_LR)]


def _snapshot(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    "change,named",
    [("model.path", "[model].path"), ("model.lora.rank=4", "[model].lora")],
    ids=["path", "lora-rank"],
)
def test_a_change_resume_cannot_apply_is_refused_and_writes_nothing(run, change, named):
    if change == "model.path":  # another model folder that exists: only the resume refuses it
        change = f'model.path="{run / "model-init"}"'
    before = _snapshot(run)
    p = trainer_cli("resume", str(run), "--set", change, "--set", "run.steps=6")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert [x for x in lines if x.startswith("error: ")] == lines[-1:] and "Traceback" not in err
    assert lines[-1].startswith("error: resume cannot change ") and named in lines[-1], err
    assert "start a new run" in lines[-1]
    assert _snapshot(run) == before


def _fake_run(tmp_path) -> TrainConfig:
    """A run folder holding only run.json (check_resume reads nothing else)."""
    cfg = _config(tmp_path / "run")
    (tmp_path / "run").mkdir()
    meta = {"run_id": "r", "start_ms": 1, "config": cfg.to_dict()}
    (tmp_path / "run" / "run.json").write_text(json.dumps(meta))
    return cfg


def _with(cfg: TrainConfig, section: str, **changes) -> TrainConfig:
    return dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)}
    )


@pytest.mark.parametrize(
    "section,changes,refused",
    [
        ("optim", {"lr": 5e-4, "betas": (0.8, 0.99), "eps": 1e-6, "grad_clip": None}, []),
        ("optim", {"ppo_epochs": 2, "mini_batches": 2, "micro_batch_tokens": 64}, []),
        ("model", {"device": "cpu", "attn_implementation": "eager"}, []),
        ("optim", {"seed": 7}, ["[optim].seed"]),
        ("model", {"dtype": "bfloat16", "num_layers": 2}, ["[model].dtype", "[model].num_layers"]),
        ("model", {"hidden_size": 64}, ["[model].hidden_size"]),
        ("model", {"vocab_size": 384}, ["[model].vocab_size"]),
        ("model", {"lora": LoraSettings()}, ["[model].lora"]),
    ],
)
def test_check_resume_applies_or_names_each_refused_key(tmp_path, section, changes, refused):
    cfg = _with(_fake_run(tmp_path), section, **changes)
    if not refused:
        assert {k.split(".")[1] for k in check_resume(cfg)} == set(changes)
        return
    with pytest.raises(ConfigError) as exc:
        check_resume(cfg)
    assert all(name in str(exc.value) for name in refused), exc.value
    assert len(str(exc.value).splitlines()) == 1


def test_other_sections_and_the_folder_path_are_not_checked(tmp_path):
    cfg = _fake_run(tmp_path)
    assert check_resume(cfg) == {}
    moved = cfg.with_run(dir=f"{tmp_path / 'run'}/", steps=9)  # another name, the same folder
    assert check_resume(moved) == {"run.steps": (STEPS, 9)}
    assert check_resume(_with(cfg, "replay", max_uses=8)) == {"replay.max_uses": (3, 8)}


def test_every_optim_and_model_key_is_classified():
    keys = {f"optim.{f.name}" for f in dataclasses.fields(OptimConfig)}
    keys |= {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
    keys |= {f"model.lora.{f.name}" for f in dataclasses.fields(LoraSettings)}
    assert not APPLIED & REFUSED.keys()
    assert keys == APPLIED | REFUSED.keys()


def _cli_error(*args) -> str:
    p = trainer_cli(*args)
    out, err = p.communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert [x for x in lines if x.startswith("error: ")] == lines[-1:], err
    return lines[-1]


def test_a_resume_whose_store_is_gone_is_refused_and_writes_nothing(run):
    shutil.rmtree(run / "store")
    before = _snapshot(run)
    line = _cli_error("resume", str(run), "--set", "run.steps=6")
    assert line.startswith(f"error: cannot resume {run}: checkpoint {_ckpt(run, 4)} trained on")
    assert "there is no store there any more" in line and "restore that store" in line
    assert _snapshot(run) == before and not (run / "store").exists()


def test_a_resume_over_a_newer_store_in_its_place_is_refused(run):
    shutil.rmtree(run / "store")
    RolloutStore.open(run / "store")  # a new, empty store where the run's was
    before = _snapshot(run)
    with pytest.raises(RunDirError, match=r"at version \d+, and it is at version 1: an older"):
        T.train(_config(run).with_run(steps=6), resume=True, progress=False)
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda m: {k: v for k, v in m.items() if k != "config"}, "expected 'config'"),
        (lambda m: {**m, "run_id": 7}, "expected 'run_id'"),
        (lambda m: {**m, "resumes": [{"step": 2}]}, "expected 'resumes'"),
        (lambda m: [m], "expected a JSON object"),
    ],
    ids=["no-config", "run-id", "resumes", "list"],
)
def test_a_damaged_run_json_is_one_error_line(tmp_path, damage, named):
    _fake_run(tmp_path)
    path = tmp_path / "run" / "run.json"
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.raises(RunDirError, match=f"{path} is damaged: {named}"):
        check_resume(_config(tmp_path / "run"))
    line = _cli_error("resume", str(tmp_path / "run"))
    assert line.startswith(f"error: {path} is damaged: {named}") and "start a new run" in line
