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
