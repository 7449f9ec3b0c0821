"""Same seed + same config = the same run, wherever its folder is (issue #33 item 7).

Two fresh runs of one config in two folders, with no ``run_id`` and no ``id_time_ms`` set
(ids default to "seeded"), must write the same rows (rollout ids included), draw the same
rollouts at every learner step and end with the same weights, bit for bit. ``ids = "clock"``
keeps the old per-run ids; a twin writing into the store of its first copy is refused.
"""

from __future__ import annotations

import tomllib

import pytest
from helpers import TINY_RUN_TOML, run_draws

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.errors import RunDirError
from trainer.run.sync import train

STEPS = 4
RUN = (
    TINY_RUN_TOML
    + """
[loss]
entropy_coef = 0.01
[optim]
lr = 1e-3
[run]
dir = "{dir}"
steps = {steps}
updates_per_round = 2
batch_size = 8
checkpoint_every = {steps}
{extra}
"""
)
COLUMNS = ["rollout_id", "group_id", "prompt_ids", "completion_ids", "behavior_logprobs", "reward"]


def config(run_dir, extra: str = "", steps: int = STEPS) -> TrainConfig:
    return TrainConfig.from_dict(tomllib.loads(RUN.format(dir=run_dir, steps=steps, extra=extra)))


def rows(run_dir) -> list[dict]:
    t = RolloutStore.open(run_dir / "store", create=False).sql(
        f"SELECT {', '.join(COLUMNS)} FROM rollouts ORDER BY rollout_id"
    )
    return t.to_pylist()


def weights(run_dir) -> bytes:
    return (run_dir / "checkpoints" / f"step-{STEPS:09d}" / "model.safetensors").read_bytes()


def test_twin_runs_in_two_folders_write_the_same_rows_draws_and_weights(tmp_path):
    a, b = tmp_path / "first" / "run-a", tmp_path / "second" / "run-b"
    for d in (a, b):
        train(config(d), progress=False)
    assert rows(a) == rows(b)
    assert len(rows(a)) == 2 * 6 * 4  # two rounds of 6 prompts x 4 samples, nothing skipped
    assert run_draws(a) == run_draws(b)
    assert sorted(run_draws(a)) == list(range(STEPS))  # learner steps 0..STEPS-1
    assert weights(a) == weights(b)


def test_clock_ids_differ_between_folders_and_seeded_ids_ignore_id_time(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        train(config(d, 'ids = "clock"', steps=1), progress=False)
    ids_a = {r["rollout_id"] for r in rows(a)}
    ids_b = {r["rollout_id"] for r in rows(b)}
    assert ids_a and not ids_a & ids_b  # the run id (folder name) is in every clock id
    # the same tokens all the same: only the ids follow the folder and the clock
    assert [r["completion_ids"] for r in rows(a)] != [] and sorted(
        r["completion_ids"] for r in rows(a)
    ) == sorted(r["completion_ids"] for r in rows(b))


def test_a_twin_writing_into_its_first_copys_store_is_refused(tmp_path):
    store = tmp_path / "shared-store"
    first = config(tmp_path / "one", f'store = "{store}"', steps=1)
    train(first, progress=False)
    twin = config(tmp_path / "two", f'store = "{store}"', steps=1)
    before = RolloutStore.open(store, create=False).version
    with pytest.raises(RunDirError, match=r"written by run 'one'.*\[run\]\.run_id"):
        train(twin, progress=False)
    assert not (tmp_path / "two").exists()  # a failed fresh start leaves no folder
    assert RolloutStore.open(store, create=False).version == before
    # its own run id makes it another run: its ids differ, it runs
    train(config(tmp_path / "two", f'store = "{store}"\nrun_id = "two"', steps=1), progress=False)
    runs = RolloutStore.open(store, create=False).sql(
        "SELECT run_id, count(*) AS n FROM rollouts GROUP BY 1 ORDER BY 1"
    )
    assert runs.to_pylist() == [{"run_id": "one", "n": 24}, {"run_id": "two", "n": 24}]
