from __future__ import annotations

import json

from trainer.run.plot import load_metrics, plot_run, reward_lines


def test_plots_every_series_from_metrics(tmp_path):
    recs = [{"kind": "eval", "step": 0, "reward": 0.2, "generated_tokens": 0}]
    for s in range(1, 11):
        recs.append(
            {
                "kind": "train",
                "step": s,
                "reward": s / 10,
                "entropy": 1 / s,
                "staleness": s % 3,
                "generated_tokens": 100 * s,
            }
        )
    recs.append({"kind": "eval", "step": 10, "reward": 0.7, "generated_tokens": 1000})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert len(load_metrics(tmp_path)["train"]) == 10
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["entropy.png", "reward.png", "staleness.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_reward_plot_draws_the_policys_own_reward_beside_the_replayed_batch(tmp_path):
    recs = [
        {"kind": "generate", "step": 0, "round": 0, "tokens": 50, "reward": 0.01},
        {"kind": "train", "step": 1, "reward": 0.56, "generated_tokens": 50},
        {"kind": "generate", "step": 1, "round": 1, "tokens": 70, "reward": 0.02},
        {"kind": "train", "step": 2, "reward": 0.55, "generated_tokens": 120},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = {label: [(r["step"], r["generated_tokens"], r[k]) for r in rs] for label, rs, k in
             reward_lines(load_metrics(tmp_path))}  # fmt: skip
    assert lines["batch reward (replayed)"] == [(1, 50, 0.56), (2, 120, 0.55)]
    assert lines["policy's own reward (each generation round)"] == [(0, 50, 0.01), (1, 120, 0.02)]
    assert (tmp_path / "plots" / "reward.png") in plot_run(tmp_path)


def test_sync_train_records_and_progress_bar_carry_the_policys_own_reward(tmp_path):
    from trainer.config import TrainConfig
    from trainer.run.loop import postfix
    from trainer.run.sync import train

    cfg = TrainConfig.from_dict(
        {
            "model": {"num_layers": 1},
            "task": {"options": {"max_operands": 2, "max_digits": 1}},
            "generation": {"group_size": 2, "max_tokens": 4, "prompts_per_round": 4},
            "run": {"dir": str(tmp_path / "run"), "steps": 3, "updates_per_round": 2,
                    "batch_size": 4, "checkpoint_every": 3},
            "eval": {"prompts": 0, "every": 0},
        }
    )  # fmt: skip
    train(cfg, progress=False)
    m = load_metrics(tmp_path / "run")
    gens = m["generate"]
    assert len(gens) == 2  # rounds at steps 0 and 2
    # Each train record: the newest round's mean reward as policy_reward.
    assert [t["policy_reward"] for t in m["train"]] == [gens[0]["reward"]] * 2 + [gens[1]["reward"]]
    shown = postfix(m["train"][-1])
    assert shown["replayed"] == f"{m['train'][-1]['reward']:.2f}"
    assert shown["policy"] == f"{gens[1]['reward']:.2f}"
