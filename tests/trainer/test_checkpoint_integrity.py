"""Damaged checkpoints: manifest, verification, fallback to the newest good one (issue 20)."""

from __future__ import annotations

import json
import shutil
import tomllib

import pytest
import torch
from helpers import inject_fault, resumable_run_toml, with_eval

import trainer.run.checkpoint as C
import trainer.run.sync as T
from trainer.cli import main as cli_main
from trainer.config import TrainConfig


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _save(run_dir, step: int, seed: int) -> torch.nn.Module:
    """A checkpoint shaped like the trainer's: the learner state holds the weights and RNG."""
    m = _model(seed)
    weights = m.state_dict()
    learner = {"model": weights, "steps_done": step, "torch_rng": torch.get_rng_state()}
    C.save_checkpoint(
        run_dir,
        step,
        model=weights,
        trainer_state={"learner": learner},
        state={"loader": {"step": step}},
        keep=5,
    )
    return m


def damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # garbage of the same size: only the sha256 (or parsing) can tell
        path.write_bytes(bytes((b * 7 + 13) % 256 for b in data))


FILES = ["model.safetensors", "trainer.pt", "state.json"]
DAMAGE = ["truncate", "empty", "garbage"]


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "legacy-no-manifest"])
@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, name, how, manifest):
    good = _save(tmp_path, 1, seed=1)
    _save(tmp_path, 2, seed=2)
    newest = C.latest_checkpoint(tmp_path)
    if not manifest:
        (newest / C.MANIFEST).unlink()
    damage(newest / name, how)
    warnings: list[str] = []
    ckpt = C.newest_good_checkpoint(tmp_path, warn=warnings.append)
    assert ckpt.path.name == C.STEP_FMT.format(1) and ckpt.state["step"] == 1
    assert len(warnings) == 1 and str(newest) in warnings[0] and name in warnings[0]
    assert "\n" not in warnings[0]
    m = _model(seed=9)
    trainer_state, _ = ckpt.restore(m)
    for a, b in zip(good.state_dict().values(), m.state_dict().values()):
        assert torch.equal(a, b)
    assert trainer_state["learner"]["steps_done"] == 1
    with pytest.raises(C.CheckpointError, match=str(newest)):
        C.load_checkpoint(newest, _model(0))


def test_no_good_checkpoint_is_one_error_line_naming_each(tmp_path):
    assert C.newest_good_checkpoint(tmp_path) is None  # nothing saved: a fresh start
    _save(tmp_path, 1, seed=1)
    _save(tmp_path, 2, seed=2)
    damage(C.list_checkpoints(tmp_path)[0] / "trainer.pt", "truncate")
    damage(C.list_checkpoints(tmp_path)[1] / "state.json", "garbage")
    with pytest.raises(C.CheckpointError) as err:
        C.newest_good_checkpoint(tmp_path, warn=pytest.fail)
    msg = str(err.value)
    assert "\n" not in msg
    assert "step-000000001: trainer.pt" in msg and "step-000000002: state.json" in msg


def test_manifest_is_written_last_and_lists_every_file(tmp_path):
    _save(tmp_path, 1, seed=1)
    path = C.latest_checkpoint(tmp_path)
    files = json.loads((path / C.MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(FILES)
    assert all(files[f]["size"] == (path / f).stat().st_size for f in FILES)
    newest_mtime = max((path / f).stat().st_mtime_ns for f in FILES)
    assert (path / C.MANIFEST).stat().st_mtime_ns >= newest_mtime
    assert sorted(p.name for p in path.iterdir()) == sorted([*FILES, C.MANIFEST])


def test_weights_and_rng_are_written_once_and_old_checkpoints_still_load(tmp_path):
    m = _save(tmp_path, 1, seed=1)
    path = C.latest_checkpoint(tmp_path)
    raw = torch.load(path / "trainer.pt", weights_only=False)
    assert raw["learner"]["model"] == "<model.safetensors>"
    assert raw["learner"]["torch_rng"] == "<rng.torch>"
    assert isinstance(raw["rng"]["torch"], torch.Tensor)
    ckpt = C.read_checkpoint(path)
    restored = ckpt.trainer_state["learner"]
    assert restored["model"].keys() == m.state_dict().keys()
    assert all(torch.equal(restored["model"][k], v) for k, v in m.state_dict().items())
    assert torch.equal(restored["torch_rng"], raw["rng"]["torch"])

    # The layout of earlier versions: weights and RNG in trainer.pt as well, no manifest.
    old = tmp_path / "old" / "checkpoints" / C.STEP_FMT.format(3)
    shutil.copytree(path, old)
    (old / C.MANIFEST).unlink()
    legacy = {**raw, "learner": {**raw["learner"], "model": m.state_dict()}}
    legacy["learner"]["torch_rng"] = raw["rng"]["torch"].clone()
    torch.save(legacy, old / "trainer.pt")
    trainer_state, state = C.load_checkpoint(old, _model(seed=9))
    assert state["step"] == 1
    assert all(
        torch.equal(trainer_state["learner"]["model"][k], v) for k, v in m.state_dict().items()
    )
    assert torch.equal(trainer_state["learner"]["torch_rng"], raw["rng"]["torch"])


def test_abandoned_saves_are_removed(tmp_path):
    _save(tmp_path, 1, seed=1)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-000000002-1234abcd").mkdir()
    (root / ".tmp-step-000000002-1234abcd" / "model.safetensors").write_bytes(b"half")
    gone = C.remove_abandoned_saves(tmp_path)
    assert [p.name for p in gone] == [".tmp-step-000000002-1234abcd"]
    assert sorted(p.name for p in root.iterdir()) == [C.STEP_FMT.format(1)]


# -- a real run: kill it, damage its newest checkpoint, resume ---------------------------------
STEPS = 8
RUN = with_eval(
    resumable_run_toml(
        "integrity",
        """
updates_per_round = 2
batch_size = 8
checkpoint_every = 3
keep_checkpoints = 10
warm_start_steps = 1
""",
    ),
    every=0,
)


class Killed(BaseException):
    """The injected fault: unwinds the run like a kill (no handler writes anything)."""


def _config(run_dir) -> TrainConfig:
    return TrainConfig.from_dict(tomllib.loads(RUN.format(dir=run_dir, steps=STEPS)))


def _final(run_dir) -> bytes:
    return (run_dir / "checkpoints" / C.STEP_FMT.format(STEPS) / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """(uninterrupted final weights, a run killed at step 8 with checkpoints 3 and 6 and an
    abandoned save)."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    T.train(_config(ref), progress=False)
    run = tmp_path_factory.mktemp("killed") / "run"

    def fault(where: str) -> None:
        if where == f"step:{STEPS}":
            raise Killed(where)

    mp = pytest.MonkeyPatch()
    inject_fault(mp, fault)
    try:
        with pytest.raises(Killed):
            T.train(_config(run), progress=False)
    finally:
        mp.undo()
    (run / "checkpoints" / ".tmp-step-000000008-0badf00d").mkdir()
    assert [p.name for p in C.list_checkpoints(run)] == [C.STEP_FMT.format(s) for s in (3, 6)]
    return _final(ref), run


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,how", list(zip(FILES, DAMAGE)) + [("model.safetensors", "empty")], ids=str
)
def test_resume_past_a_damaged_checkpoint_equals_the_uninterrupted_run(
    tmp_path, killed_run, capfd, name, how
):
    want, killed = killed_run
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    bad = run / "checkpoints" / C.STEP_FMT.format(6)
    damage(bad / name, how)
    capfd.readouterr()
    T.train(_config(run), resume=True, progress=False)
    lines = [x for x in capfd.readouterr().err.splitlines() if "checkpoint" in x]
    assert len(lines) == 1 and str(bad) in lines[0] and "step-000000003" in lines[0], lines
    assert not list((run / "checkpoints").glob(".tmp-step-*"))  # the abandoned save is gone
    # Resumed from step 3 (the store already holds the rounds the killed run appended after it).
    assert _final(run) == want


@pytest.mark.slow
def test_resume_with_no_good_checkpoint_is_one_error_line(tmp_path, killed_run, capfd):
    _, killed = killed_run
    run = tmp_path / "run"
    shutil.copytree(killed, run)
    for path in C.list_checkpoints(run):
        damage(path / "trainer.pt", "truncate")
    capfd.readouterr()
    assert cli_main(["resume", str(run), "-q"]) == 2
    err = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "no usable checkpoint" in err[0], err
    assert "step-000000003: trainer.pt" in err[0] and "step-000000006: trainer.pt" in err[0]
