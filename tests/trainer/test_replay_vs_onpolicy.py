"""Fast checks of tools/replay_vs_onpolicy.py: config building and summarising (no training)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "replay_vs_onpolicy", ROOT / "tools" / "replay_vs_onpolicy.py"
)
rvo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rvo)


def _cfgs(tmp_path, **kw):
    base = rvo.load_base(ROOT / "examples" / "arith.toml")
    return rvo.build_configs(base, seed=3, token_budget=6000, run_root=tmp_path, **kw)


def test_three_configs_share_the_learner_and_differ_in_replay(tmp_path):
    cfgs = _cfgs(tmp_path)
    assert list(cfgs) == list(rvo.CONFIGS)
    on, rep, cor = cfgs["onpolicy"], cfgs["replay"], cfgs["replay_tis_div"]
    for c in cfgs.values():
        assert (c.run.updates_per_round, c.run.batch_size, c.run.seed) == (2, 64, 3)
        assert c.run.warm_start_steps == 100 and c.model.path == "tiny"
        assert c.replay.seed == 3 and c.replay.priority == "uniform"
    # (a) each rollout once: rollouts per round == updates x batch, window == one round.
    rollouts = on.generation.prompts_per_round * on.generation.group_size
    assert rollouts == 128 == on.run.updates_per_round * on.run.batch_size
    assert (on.replay.window, on.replay.max_uses, on.replay.max_staleness) == (128, 1, 2)
    assert on.loss.loss_type == "ppo"
    # (b) half the generation, window 1024, replay ratio 2, plain ppo.
    assert rep.generation.prompts_per_round * rep.generation.group_size == 64
    assert (rep.replay.window, rep.replay.max_uses, rep.replay.diversity) == (1024, None, "none")
    assert rep.loss.loss_type == "ppo"
    # (c) as (b) plus a correction and prompt diversity.
    assert cor.generation == rep.generation and cor.replay.window == 1024
    assert (cor.loss.loss_type, cor.replay.diversity) == ("tis", "prompt")
    # Equal budget: half the rollouts per round -> twice the steps; evals at equal rollouts.
    assert (on.run.steps, rep.run.steps) == (32, 64)
    assert on.eval.every * 128 == rep.eval.every * 64
    assert Path(on.run.dir) == tmp_path / "onpolicy-s3"
    # The overrides round-trip through the config file format.
    assert type(on).from_dict(on.to_dict()) == on


def test_steps_cover_the_budget():
    # 6000 tokens / (128 rollouts x 3 tokens) = 15.6 -> 16 rounds -> 32 steps.
    assert rvo.steps_for_budget(6000, 128, 2, 3.0) == 32
    assert rvo.steps_for_budget(6000, 64, 2, 3.0) == 64
    assert rvo.steps_for_budget(1, 64, 2, 3.0) == 2


def test_correction_choice(tmp_path):
    assert _cfgs(tmp_path, correction="decoupled")["replay_tis_div"].loss.loss_type == "decoupled"


def test_summarise_truncates_at_the_budget():
    recs = [{"kind": "eval", "step": 0, "reward": 0.3, "generated_tokens": 0}]
    for s in range(1, 9):
        recs.append(
            {
                "kind": "train",
                "step": s,
                "entropy": 1.0 / s,
                "generated_tokens": 100 * ((s + 1) // 2),
                "gen_seconds": 0.1 * s,
                "train_seconds": 0.2 * s,
            }
        )
        if s % 2 == 0:
            recs.append(
                {
                    "kind": "eval",
                    "step": s,
                    "reward": 0.2 + 0.1 * s,
                    "generated_tokens": 100 * (s // 2),
                    "gen_seconds": 0.1 * s,
                    "train_seconds": 0.2 * s,
                }
            )
    out = rvo.summarise(recs, budget=300, target=0.6)
    assert out["steps"] == 6 and out["tokens"] == 300
    assert out["final_reward"] == 0.8 and out["final_entropy"] == 1.0 / 6
    assert out["hit_tokens"] == 200 and abs(out["hit_seconds"] - 1.2) < 1e-9
    assert rvo.summarise(recs, budget=300, target=0.95)["hit_tokens"] is None
