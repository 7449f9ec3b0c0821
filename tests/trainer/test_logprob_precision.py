"""The learner's side of ``[store] logprob_precision``: a run may not ask for more error than
its loss tolerates, and the learner refuses a store that records more than either allows."""

from __future__ import annotations

import pytest

from rolloutstore import RolloutStore
from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.run.setup import check_logprob_precision


def _store(tmp_path, bound: float) -> RolloutStore:
    store = RolloutStore.open(tmp_path / "store")
    store.set_logprob_precision(bound)
    return store


def test_config_refuses_a_precision_the_loss_does_not_tolerate():
    with pytest.raises(ConfigError, match=r"\[loss\].logprob_tolerance"):
        TrainConfig.from_dict({"store": {"logprob_precision": 0.05}})
    with pytest.raises(ConfigError, match=r"\[store\].logprob_precision"):
        TrainConfig.from_dict({"store": {"logprob_precision": -1.0}})
    cfg = TrainConfig.from_dict(
        {"store": {"logprob_precision": 0.05}, "loss": {"logprob_tolerance": 0.1}}
    )
    assert cfg.store.logprob_precision == 0.05
    assert TrainConfig.from_dict({}).store.logprob_precision == 0.0  # lossless by default


def test_learner_refuses_a_store_coarser_than_the_loss_tolerates(tmp_path):
    store = _store(tmp_path, 0.05)
    cfg = TrainConfig.from_dict(
        {"store": {"logprob_precision": 0.05}, "loss": {"logprob_tolerance": 0.1}}
    )
    check_logprob_precision(store, cfg)  # within both
    strict = TrainConfig.from_dict({"store": {"logprob_precision": 0.01}})
    with pytest.raises(ConfigError, match=r"0\.05 nats.*logprob_tolerance = 0\.01"):
        check_logprob_precision(store, strict)


def test_learner_refuses_a_store_coarser_than_the_run_asks(tmp_path):
    """A lossless run (the default) on a store that rounds its log-probs is refused, naming
    the setting that would accept it."""
    store = _store(tmp_path, 1e-3)
    with pytest.raises(ConfigError, match=r"logprob_precision = 0\.001"):
        check_logprob_precision(store, TrainConfig.from_dict({}))
    check_logprob_precision(store, TrainConfig.from_dict({"store": {"logprob_precision": 1e-3}}))


@pytest.mark.slow
def test_a_run_records_its_bound_and_appends_on_the_grid(tmp_path):
    """End to end: [store].logprob_precision reaches the store's metadata before the first
    append, every stored log-prob sits on the bound's grid, and a lossless config is then
    refused on that store."""
    import numpy as np
    import pyarrow.compute as pc

    from rolloutstore.store.precision import grid_step
    from trainer.run.sync import train

    base = {
        "model": {"num_layers": 1},
        "task": {"options": {"max_operands": 2, "max_digits": 1, "ops": ["+"]}},
        "eval": {"prompts": 0},
        "generation": {"group_size": 4, "max_tokens": 5, "prompts_per_round": 4},
        "run": {"dir": str(tmp_path / "run"), "steps": 2, "batch_size": 8,
                "updates_per_round": 1, "checkpoint_every": 2},
    }  # fmt: skip
    train(TrainConfig.from_dict({**base, "store": {"logprob_precision": 1e-3}}))
    store = RolloutStore.open(tmp_path / "run" / "store", create=False)
    assert store.logprob_precision == 1e-3 and store.count() > 0
    lp = pc.list_flatten(store.dataset().to_table()["behavior_logprobs"]).to_numpy()
    step = grid_step(1e-3)
    assert np.array_equal(np.rint(lp / step) * step, lp)  # on the grid: rounded when stored
    assert np.any(lp != 0)
    with pytest.raises(ConfigError, match="never lowered"):
        train(TrainConfig.from_dict({**base, "run": {**base["run"], "dir": str(tmp_path / "b"),
              "store": str(tmp_path / "run" / "store")}}))  # fmt: skip
