"""The run config's keys: every one documented, the keys that follow ``[run]`` (seeds,
``optim.total_steps``), the one gradient-checkpointing key, and None as top-k / top-p "off"
from the TOML to the learner."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from trainer.config import DEPRECATED, FOLLOW_RUN, SECTIONS, RunConfig, TrainConfig
from trainer.control import ControlConfig
from trainer.errors import ConfigError
from trainer.models.lora import LoraSettings
from trainer.rollout.ray_config import RayConfig
from trainer.rollout.sampling import GenerationConfig, SamplingParams

TABLES = {
    **SECTIONS,
    "replay.control": ControlConfig,
    "model.lora": LoraSettings,
    "run.ray": RayConfig,
}


# -- every key documented ------------------------------------------------------------------------
@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_field_of_every_table_has_help(table: str) -> None:
    missing = [
        f.name
        for f in dataclasses.fields(TABLES[table])
        if not str(f.metadata.get("help", "")).strip()
    ]
    assert not missing, f"[{table}] fields without help text (use help_field): {missing}"


# -- keys that follow [run] ----------------------------------------------------------------------
def _derived(cfg: TrainConfig) -> dict[tuple[str, str], object]:
    return {(s, k): getattr(getattr(cfg, s), k) for s, k in FOLLOW_RUN}


def test_unset_seeds_and_total_steps_follow_run() -> None:
    cfg = TrainConfig.from_dict({"run": {"seed": 7, "steps": 12}})
    assert _derived(cfg) == {
        ("model", "seed"): 7,
        ("replay", "seed"): 7,
        ("optim", "seed"): 7,
        ("optim", "total_steps"): 12,
    }
    # Built in Python the same: None means "follow [run]".
    assert TrainConfig(run=RunConfig(seed=7, steps=12)) == cfg


def test_the_default_config_keeps_its_old_seeds() -> None:
    """run.seed defaults to 0, as every per-table seed did: a config that sets none of them
    draws the same batches, the same tiny model and the same mini-batch order as before."""
    cfg = TrainConfig.from_dict({})
    assert _derived(cfg) == {
        ("model", "seed"): 0,
        ("replay", "seed"): 0,
        ("optim", "seed"): 0,
        ("optim", "total_steps"): RunConfig().steps,
    }


def test_explicit_values_win_and_round_trip() -> None:
    explicit = {
        "model": {"seed": 0},
        "replay": {"seed": 1},
        "optim": {"seed": 2, "total_steps": 100, "lr_schedule": "cosine"},
        "run": {"seed": 9, "steps": 30},
    }
    cfg = TrainConfig.from_dict(explicit)
    assert _derived(cfg) == {
        ("model", "seed"): 0,
        ("replay", "seed"): 1,
        ("optim", "seed"): 2,
        ("optim", "total_steps"): 100,
    }
    # run.json holds the resolved values: a resume reads the same config.
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_cosine_takes_total_steps_from_run() -> None:
    cfg = TrainConfig.from_dict({"optim": {"lr_schedule": "cosine"}, "run": {"steps": 20}})
    assert cfg.optim.total_steps == 20
    assert cfg.optim.lr_factor(19) < cfg.optim.lr_factor(0) == 1.0


def test_with_run_moves_the_keys_that_follow_it() -> None:
    cfg = TrainConfig.from_dict({"replay": {"seed": 5}, "run": {"seed": 1, "steps": 10}})
    moved = cfg.with_run(seed=3, steps=20)
    assert _derived(moved) == {
        ("model", "seed"): 3,
        ("replay", "seed"): 5,  # set explicitly: stays
        ("optim", "seed"): 3,
        ("optim", "total_steps"): 20,
    }
    assert cfg.with_run(actors=2).optim == cfg.optim


@pytest.mark.parametrize(
    ("section", "values", "needle"),
    [
        ("model", {"seed": "one"}, "[model].seed"),
        ("replay", {"seed": 1.5}, "ReplayConfig.seed"),
        ("optim", {"seed": True}, "OptimConfig.seed"),
        ("optim", {"total_steps": 0}, "OptimConfig.total_steps"),
    ],
)
def test_bad_seeds_name_the_key(section: str, values: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict({section: values})
    assert needle in str(exc.value)


# -- one gradient-checkpointing key ---------------------------------------------------------------
def test_one_gradient_checkpointing_key() -> None:
    optim_keys = {f.name for f in dataclasses.fields(SECTIONS["optim"])}
    assert "grad_checkpointing" not in optim_keys
    assert DEPRECATED == {("optim", "grad_checkpointing"): ("model", "gradient_checkpointing")}
    cfg = TrainConfig.from_dict({"model": {"gradient_checkpointing": True}})
    assert cfg.model.gradient_checkpointing and "grad_checkpointing" not in cfg.to_dict()["optim"]


def test_the_old_key_is_read_as_the_kept_one_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match=r"\[model\]\.gradient_checkpointing = true"):
        cfg = TrainConfig.from_dict({"optim": {"grad_checkpointing": True}})
    assert cfg.model.gradient_checkpointing
    # A run.json written before holds it (false): read silently, changes nothing.
    old = TrainConfig().to_dict()
    old["optim"]["grad_checkpointing"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainConfig.from_dict(old) == TrainConfig()
    with pytest.raises(ConfigError, match=r"\[optim\]\.grad_checkpointing .* true or false"):
        TrainConfig.from_dict({"optim": {"grad_checkpointing": "yes"}})


def test_build_learner_turns_checkpointing_on_from_the_model_key(monkeypatch) -> None:
    from trainer.run import setup

    monkeypatch.setattr(setup, "Learner", lambda model, loss, optim, **kw: kw)
    kw = setup.build_learner(
        TrainConfig.from_dict({"model": {"gradient_checkpointing": True}}),
        None,
        torch.device("cpu"),
    )
    assert kw["gradient_checkpointing"] is True


# -- None as top-k / top-p "off" -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "held"),
    [
        ({}, (None, None)),
        ({"top_k": 0, "top_p": 1.0}, (None, None)),  # how older configs wrote "off"
        ({"top_k": None, "top_p": None}, (None, None)),  # a run.json's null
        ({"top_k": 5, "top_p": 0.9}, (5, 0.9)),
    ],
)
def test_top_k_top_p_off_is_none_in_config_and_learner(monkeypatch, given, held) -> None:
    from trainer.run import setup

    cfg = TrainConfig.from_dict({"generation": given})
    assert (cfg.generation.top_k, cfg.generation.top_p) == held
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    monkeypatch.setattr(setup, "Learner", lambda model, loss, optim, **kw: kw)
    kw = setup.build_learner(cfg, None, torch.device("cpu"))
    assert (kw["top_k"], kw["top_p"]) == held
    # Rows (and the generators) keep 0 / 1.0 as "off": the store schema is unchanged.
    s = cfg.generation.sampling()
    assert (s.top_k, s.top_p) == (held[0] or 0, held[1] or 1.0)


def test_sampling_params_take_none_as_off_and_hold_it_as_rows_do() -> None:
    s = SamplingParams(top_k=None, top_p=None)
    assert (s.top_k, s.top_p) == (0, 1.0)


@pytest.mark.parametrize(
    ("values", "needle"),
    [({"top_k": -1}, "top_k must be"), ({"top_p": 0}, "top_p must be"), ({"top_k": 1.5}, "top_k")],
)
def test_bad_top_k_top_p_still_refused(values: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(**values)
