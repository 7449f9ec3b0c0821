from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import trainer.rollout.weights as W
import trainer.run.checkpoint as C


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_round_trip_is_exact_and_restores_rng(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    C.save_checkpoint(
        tmp_path,
        5,
        model=m,
        trainer_state={"optimizer": opt.state_dict()},
        state={"policy_version": 5, "loader": {"step": 5}},
    )
    expect = (random.random(), np.random.rand(), torch.rand(1))
    m2 = _model(seed=9)
    trainer_state, state = C.load_checkpoint(C.latest_checkpoint(tmp_path), m2)
    assert state == {"policy_version": 5, "loader": {"step": 5}, "step": 5}
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    opt2.load_state_dict(trainer_state["optimizer"])
    assert (random.random(), np.random.rand()) == expect[:2] and torch.equal(
        torch.rand(1), expect[2]
    )


def test_keeps_the_last_k_and_failed_saves_leave_nothing(tmp_path, monkeypatch):
    m = _model()
    for step in range(1, 6):
        C.save_checkpoint(tmp_path, step, model=m, trainer_state={}, state={}, keep=2)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == [
        C.STEP_FMT.format(4),
        C.STEP_FMT.format(5),
    ]

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(C.torch, "save", boom)
    with pytest.raises(OSError):
        C.save_checkpoint(tmp_path, 6, model=m, trainer_state={}, state={}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [C.STEP_FMT.format(4), C.STEP_FMT.format(5)]


def test_publish_weights_latest_and_keep(tmp_path):
    m = _model()
    assert W.latest_weights(tmp_path) is None
    (tmp_path / "tmpl").mkdir()
    (tmp_path / "tmpl" / "config.json").write_text("{}")
    for v in range(4):
        W.publish_weights(tmp_path / "w", v, m, template=tmp_path / "tmpl", keep=2)
    version, path = W.latest_weights(tmp_path / "w")
    assert (
        version == 3 and (path / "model.safetensors").exists() and (path / "config.json").exists()
    )
    assert sorted(p.name for p in (tmp_path / "w").iterdir() if p.is_dir()) == [
        "v-000000002",
        "v-000000003",
    ]
