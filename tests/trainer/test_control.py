"""The replay-ratio controller: its rule, its config, and the sync loop driven by it.

Unit tests feed the rule hand-made signals; the end-to-end tests run the real sync loop
(tiny model, real store, real training) with a target no replayed data can meet, so the
controller must walk y down to its minimum, and check that resume after SIGKILL is still
bit-for-bit the uninterrupted run while y changes.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from helpers import run_draws, trainer_cli

from rolloutstore import RolloutStore
from trainer.config import ConfigError, TrainConfig
from trainer.control import ControlConfig, ReplayController, reward_trend, reward_trend_se

ROOT = Path(__file__).parents[2]

# Signals comfortably inside the default targets (ess 0.9, clip 0.05, kl 0.02, margin 0.5).
CALM = {"ess_frac": 0.99, "clip_frac": 0.01, "approx_kl": 0.001, "staleness": 1.0}


def _ctl(**kw) -> ReplayController:
    kw.setdefault("enabled", True)
    updates, fresh = kw.pop("updates", 4), kw.pop("fresh", 0.0)
    return ReplayController(ControlConfig(**kw), updates=updates, fresh=fresh)


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"ess_frac": 0.8}, "ess"),
        ({"clip_frac": 0.2}, "clip"),
        ({"approx_kl": 0.05}, "kl"),
        ({"staleness": 12.0}, "staleness"),
        ({"reward_trend": -0.2}, "reward trend"),
    ],
)
def test_each_off_policy_signal_lowers_y(bad, named):
    c = _ctl(max_mean_staleness=8.0, min_updates=1, max_updates=8)
    d = c.decide(1, {**CALM, "reward_trend": 0.0, **bad})
    assert d.verdict == "back_off" and (d.old_updates, d.new_updates) == (4, 3)
    assert c.updates == 3 and d.changed
    assert d.reason.startswith(named)  # the reason names the signal
    rec = d.record()
    assert rec["updates_per_round"] == 3 and rec["old_updates_per_round"] == 4
    assert all(rec[f"in_{k}"] == v for k, v in {**CALM, **bad}.items())


def test_comfortable_rounds_raise_y_after_patience_and_bounds_hold():
    c = _ctl(min_updates=2, max_updates=5, patience=2, updates=4)
    seen = [c.decide(r, CALM).new_updates for r in range(1, 7)]
    # One notch per `patience` comfortable rounds, never above max_updates.
    assert seen == [4, 5, 5, 5, 5, 5]
    for r in range(10):
        c.decide(r, {**CALM, "approx_kl": 1.0})
    assert c.updates == 2  # never below min_updates
    d = c.decide(11, {**CALM, "approx_kl": 1.0})
    assert not d.changed and "already at the bound" in d.reason
    # The starting value is clamped into the bounds too.
    assert _ctl(min_updates=2, max_updates=3, updates=7).updates == 3


def test_hysteresis_band_holds_and_resets_the_streak():
    c = _ctl(patience=2, updates=3)
    # KL between margin x target (0.01) and target (0.02): within target, not comfortable.
    band = {**CALM, "approx_kl": 0.015}
    verdicts = []
    for r in range(8):  # comfortable, band, comfortable, band, ...: never two calm in a row
        verdicts.append(c.decide(r, CALM if r % 2 == 0 else band).verdict)
    assert set(verdicts) == {"hold"} and c.updates == 3
    assert c.decide(9, CALM).verdict == "hold" and c.decide(10, CALM).verdict == "speed_up"
    assert c.updates == 4


def test_fresh_fraction_moves_when_y_is_at_its_bound_or_is_the_only_knob():
    both = _ctl(adjust="both", min_updates=1, max_updates=2, updates=2, fresh_step=0.25)
    hot = {**CALM, "clip_frac": 0.5}
    changes = [(d.new_updates, d.new_fresh) for d in (both.decide(r, hot) for r in range(4))]
    # One change per round: y first, then fresh_fraction, up to max_fresh (0.5).
    assert changes == [(1, 0.0), (1, 0.25), (1, 0.5), (1, 0.5)]
    # Speeding up undoes it in the opposite order: fresh_fraction back down first, then y.
    ups = [(d.new_updates, d.new_fresh) for d in (both.decide(r, CALM) for r in range(8))]
    assert ups[1::2] == [(1, 0.25), (1, 0.0), (2, 0.0), (2, 0.0)]
    only = _ctl(adjust="fresh", updates=3, fresh=0.1, min_fresh=0.2)
    assert only.fresh == 0.2  # clamped into [min_fresh, max_fresh]
    d = only.decide(1, hot)
    assert (d.new_updates, d.new_fresh) == (3, 0.2 + 0.125)


def test_signals_are_round_means_and_reward_trend_needs_a_full_window():
    c = _ctl(reward_window=3)
    for ess, kl in ((0.9, 0.01), (0.7, 0.03)):
        c.observe_step({"ess_frac": ess, "clip_frac_low": 0.02, "clip_frac_high": 0.01,
                        "approx_kl": kl, "staleness": 2.0})  # fmt: skip
    for r in (0.5, 0.4):
        c.observe_round_reward(r)
    s = c.signals()
    assert s["ess_frac"] == pytest.approx(0.8) and s["approx_kl"] == pytest.approx(0.02)
    assert s["clip_frac"] == pytest.approx(0.03) and s["steps"] == 2
    assert s["reward_trend"] is None
    c.observe_round_reward(0.3)
    assert c.signals()["reward_trend"] == pytest.approx(-0.2)  # 0.5 -> 0.3 on a line
    c.decide(1)
    assert c.signals()["ess_frac"] is None  # the round's sums are reset by a decision
    assert reward_trend([0.1, 0.3, 0.2, 0.4]) == pytest.approx(0.24)  # LSQ slope 0.08 x 3


def test_a_reward_fall_within_round_noise_is_not_a_fall():
    noisy = [0.60, 0.45, 0.62, 0.40, 0.58, 0.42]  # falls, but within its round-to-round noise
    steady = [0.60, 0.57, 0.54, 0.51, 0.48, 0.45]  # the same kind of fall, without the noise
    trend, se = reward_trend_se(noisy)
    assert trend < -0.05 and se > 0.05
    for rewards, verdict in ((noisy, "hold"), (steady, "back_off")):
        c = _ctl(reward_window=6, reward_drop=0.05, reward_z=2.0)
        for _ in range(2):
            c.observe_step({"ess_frac": 0.96, "clip_frac_low": 0.02, "approx_kl": 0.008})
        for r in rewards:
            c.observe_round_reward(r)
        d = c.decide(1)
        assert d.verdict == verdict, (rewards, d.reason)
        assert d.record()["in_reward_trend_se"] == pytest.approx(reward_trend_se(rewards)[1])
    # reward_z = 0 restores the plain threshold: the noisy fall backs off too.
    c = _ctl(reward_window=6, reward_drop=0.05, reward_z=0.0)
    c.observe_step({"ess_frac": 0.96, "clip_frac_low": 0.02, "approx_kl": 0.008})
    for r in noisy:
        c.observe_round_reward(r)
    assert c.decide(1).verdict == "back_off"


def test_state_dict_round_trip_decides_identically():
    a = _ctl(patience=3)
    a.observe_round_reward(0.4)
    a.decide(1, CALM)
    a.observe_step({"ess_frac": 0.95, "approx_kl": 0.004, "clip_frac_low": 0.01})
    b = _ctl(patience=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for ctl in (a, b):
        ctl.observe_step({"ess_frac": 0.97, "approx_kl": 0.003, "clip_frac_low": 0.0})
    assert a.decide(2) == b.decide(2)
    assert a.state_dict() == b.state_dict()


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"\[replay.control\]\.max_kll: unknown key"):
        TrainConfig.from_dict({"replay": {"control": {"max_kll": 0.1}}})
    with pytest.raises(ConfigError, match=r"\[replay.control\]: min_updates \(5\) must be <="):
        TrainConfig.from_dict({"replay": {"control": {"min_updates": 5, "max_updates": 2}}})
    with pytest.raises(ConfigError, match=r"\[replay.control\]: target_ess must be in"):
        TrainConfig.from_dict({"replay": {"control": {"target_ess": 1.5}}})
    with pytest.raises(ConfigError, match=r"\[replay.control\]: adjust must be one of"):
        TrainConfig.from_dict({"replay": {"control": {"adjust": "y"}}})
    with pytest.raises(ConfigError, match=r"\[replay.control\]\.enabled: .*sync loop only"):
        TrainConfig.from_dict({"replay": {"control": {"enabled": True}}, "run": {"mode": "async"}})
    with pytest.raises(ConfigError, match=r"\[replay.control\] must be a table"):
        TrainConfig.from_dict({"replay": {"control": 3}})
    # The subtable never reaches ReplayConfig; the flat `control.key` form (--set) works too.
    cfg = TrainConfig.from_dict(
        {"replay": {"window": 8, "control": {"enabled": True}, "control.max_updates": 3}}
    )
    assert cfg.replay.window == 8 and not hasattr(cfg.replay, "control")
    assert cfg.control == ControlConfig(enabled=True, max_updates=3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig.from_dict({}).control.enabled is False  # off by default


# -- the sync loop ------------------------------------------------------------------------------
def _small(run_dir: Path, steps: int, **control) -> dict:
    return {
        "model": {"num_layers": 1},
        "task": {
            "name": "arith",
            "options": {"max_operands": 2, "max_digits": 1, "ops": ["+"]},
        },
        "generation": {
            "group_size": 4,
            "max_tokens": 5,
            "prompts_per_round": 6,
            "batch_prompts": 3,
        },
        "replay": {"window": 64, "seed": 1, "control": control},
        # Rewards of a 3-step warm start are all 0 (zero advantages): the entropy bonus keeps
        # the weights moving so that "same final weights" says something.
        "loss": {"entropy_coef": 0.01},
        "optim": {"lr": 1e-3},
        "run": {
            "dir": str(run_dir),
            "run_id": "control-test",
            "id_time_ms": 1700000000000,
            "steps": steps,
            "updates_per_round": 3,
            "batch_size": 8,
            "checkpoint_every": 2,
            "warm_start_steps": 3,
        },
        "eval": {"prompts": 4, "every": 0},
    }


# A staleness target no replay can meet (a round of y steps has mean batch staleness >= 1
# before it is cut down to y = 1, and ~0.9 at y = 1 with a 64-row window over 24-row rounds):
# every decision must back off, so y goes 3 -> 2 -> 1 and stays there. (A tight KL target
# would do the same once rewards vary; with a 3-step warm start they are mostly 0.)
TIGHT = {"enabled": True, "min_updates": 1, "max_updates": 3, "max_mean_staleness": 0.1}


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_sync_run_with_a_tight_kl_target_walks_y_down_and_logs_each_decision(tmp_path):
    from trainer.run.plot import plot_run
    from trainer.run.sync import train

    run_dir = tmp_path / "run"
    train(TrainConfig.from_dict(_small(run_dir, 8, **TIGHT)), progress=False)
    control, gens = _records(run_dir, "control"), _records(run_dir, "generate")
    # Rounds at steps 0, 3 (y=3), 5 (y=2), then every step (y=1): 8 steps -> rounds 0..5.
    assert [g["step"] for g in gens] == [0, 3, 5, 6, 7]
    assert [g["round"] for g in gens] == [0, 1, 2, 3, 4]
    assert [c["step"] for c in control] == [3, 5, 6, 7]
    assert [c["updates_per_round"] for c in control] == [2, 1, 1, 1]
    for c in control:
        assert c["verdict"] == "back_off" and "staleness" in c["reason"]
        assert c["in_staleness"] > TIGHT["max_mean_staleness"]  # the input that forced it
    assert control[-1]["reason"].endswith("already at the bound")
    # The inputs are means over exactly the learner steps of the round just finished.
    assert [c["in_steps"] for c in control] == [3, 2, 1, 1]
    train_recs = _records(run_dir, "train")
    by_step = {t["step"]: t for t in train_recs}
    rounds = [(0, 3), (3, 5), (5, 6), (6, 7)]  # (first, last) learner step index of a round
    for c, (a, b) in zip(control, rounds):
        steps = [by_step[s + 1] for s in range(a, b)]
        for key in ("ess_frac", "approx_kl", "staleness"):
            assert c[f"in_{key}"] == pytest.approx(sum(t[key] for t in steps) / len(steps))
        clip = [t["clip_frac_low"] + t["clip_frac_high"] for t in steps]
        assert c["in_clip_frac"] == pytest.approx(sum(clip) / len(clip))
    assert [t["updates_per_round"] for t in train_recs][-3:] == [1, 1, 1]
    # Each round's rollouts carry that round's ids: one generation batch pair per round.
    store = RolloutStore.open(run_dir / "store", create=False)
    assert store.count() == 5 * 6 * 4
    paths = {p.name: p for p in plot_run(run_dir)}
    assert paths["control.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write_cfg(d: Path, steps: int) -> Path:
    d.mkdir()
    data = _small(d / "run", steps, **TIGHT)
    lines = []
    for section, values in data.items():
        if section == "replay":
            values = {k: v for k, v in values.items() if k != "control"}
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict)]
        lines += [
            f"{k} = {{ {', '.join(f'{a} = {json.dumps(b)}' for a, b in v.items())} }}"
            for k, v in values.items()
            if isinstance(v, dict)
        ]
    lines.append("[replay.control]")
    lines += [f"{k} = {json.dumps(v)}" for k, v in TIGHT.items()]
    path = d / "cfg.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_sigkill_and_resume_with_the_controller_equal_the_uninterrupted_run(tmp_path):
    steps = 8
    ref = trainer_cli("train", str(_write_cfg(tmp_path / "ref", steps)))
    _, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err
    final = f"checkpoints/step-{steps:09d}/model.safetensors"
    want = (tmp_path / "ref" / "run" / final).read_bytes()
    before = f"checkpoints/step-{steps - 2:09d}/model.safetensors"
    assert (tmp_path / "ref" / "run" / before).read_bytes() != want  # training moved the weights
    # generate:3:0 dies inside round 3 (step 6, after y changed twice); step:5 dies mid-way
    # between checkpoint 4 and the next decision, so the round's partial signals must resume.
    for i, fault in enumerate(["generate:3:0", "step:5"]):
        d = tmp_path / f"crash{i}"
        crash = trainer_cli("train", str(_write_cfg(d, steps)), fault=fault)
        crash.communicate(timeout=600)
        assert crash.returncode == -signal.SIGKILL, fault
        resumed = trainer_cli("resume", str(d / "run"))
        _, err = resumed.communicate(timeout=600)
        assert resumed.returncode == 0, err
        assert (d / "run" / final).read_bytes() == want, fault
        assert run_draws(d / "run") == run_draws(tmp_path / "ref" / "run"), fault
        # The decisions after resume are the uninterrupted run's (duplicates from the replayed
        # stretch aside): same steps, same values, same inputs.
        got = {c["step"]: c for c in _records(d / "run", "control")}
        ref_ctl = {c["step"]: c for c in _records(tmp_path / "ref" / "run", "control")}
        assert got.keys() == ref_ctl.keys()
        for s, c in ref_ctl.items():
            assert {k: v for k, v in got[s].items() if k != "time"} == {
                k: v for k, v in c.items() if k != "time"
            }


def test_comparison_arm_d_is_arm_b_plus_the_controller_stopped_at_the_budget(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("rvo", ROOT / "tools" / "replay_vs_onpolicy.py")
    rvo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rvo)
    base = rvo.load_base(ROOT / "examples" / "arith.toml")
    cfgs = rvo.build_configs(base, seed=1, token_budget=6000, run_root=tmp_path)
    b, d = cfgs["replay"], cfgs["replay_control"]
    assert d.control.enabled and not b.control.enabled
    assert (d.generation, d.loss, d.replay) == (b.generation, b.loss, b.replay)
    assert d.run.max_generated_tokens == 6000 and b.run.max_generated_tokens == 0
    assert d.run.steps >= b.run.steps * d.control.max_updates // b.run.updates_per_round
    only = rvo.build_configs(
        base, seed=1, token_budget=6000, run_root=tmp_path, arms=("replay_control",),
        control_base="replay_tis_div",
    )  # fmt: skip
    assert list(only) == ["replay_control"]
    assert only["replay_control"].loss == cfgs["replay_tis_div"].loss
    # A finished run recorded before [replay.control] / max_generated_tokens existed is reused.
    run_dir = Path(b.run.dir)
    run_dir.mkdir(parents=True)
    old = b.to_dict()
    del old["replay"]["control"], old["run"]["max_generated_tokens"]
    (run_dir / "run.json").write_text(json.dumps({"config": old}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": b.run.steps}))
    assert rvo.finished(b)
    # A budget-stopped run is finished once its final eval reached the budget.
    run_dir = Path(d.run.dir)
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"config": d.to_dict()}))
    recs = [{"kind": "train", "step": 40}, {"kind": "eval", "step": 40, "generated_tokens": 5990}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert not rvo.finished(d)
    recs.append({"kind": "eval", "step": 41, "generated_tokens": 6010})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert rvo.finished(d)


def test_renamed_control_key_is_refused_naming_the_new_one():
    from trainer.config import ConfigError, TrainConfig

    with pytest.raises(
        ConfigError, match=r"\[replay.control\].max_staleness was renamed 'max_mean_staleness'"
    ):
        TrainConfig.from_dict({"replay": {"control": {"enabled": True, "max_staleness": 4.0}}})
    cfg = TrainConfig.from_dict({"replay": {"control": {"max_mean_staleness": 4.0}}})
    assert cfg.control.max_mean_staleness == 4.0
