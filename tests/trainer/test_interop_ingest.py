"""ingest --from verl|trl|openai: text rollouts become trainable rows (ids, recomputed
behaviour log-probs, group advantages) that ReplayDataset draws.

Files in tests/data follow each framework's own writer (see rolloutstore/io/interop.py):
verl's RayPPOTrainer._dump_generations JSONL, TRL's GRPOTrainer completions parquet
(log_completions=True; conversational prompts), OpenAI chat fine-tuning JSONL (+ reward).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.cli import main as store_main
from trainer.algo.advantage import group_advantages
from trainer.algo.learner import Learner
from trainer.algo.loss_config import LossConfig
from trainer.algo.optim import OptimConfig
from trainer.cli import main
from trainer.models.load import load_model
from trainer.models.tiny import make_tiny_model
from trainer.rollout.hf import teacher_forced_logprobs

DATA = Path(__file__).resolve().parents[1] / "data"
FILES = {
    "verl": DATA / "verl_rollouts.jsonl",
    "trl": DATA / "trl_completions_00012.parquet",
    "openai": DATA / "openai_chat.jsonl",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, num_layers=1, num_texts=300, chat_template=True)
    return path


def _rows(store: RolloutStore) -> list[dict]:
    return store.sql("SELECT * FROM rollouts ORDER BY group_id, sample_index").to_pylist()


@pytest.mark.parametrize("source", ["verl", "trl", "openai"])
def test_ingest_text_rollouts_then_replay(tmp_path, model_dir, source, capsys):
    uri = tmp_path / "store"
    rc = main(["ingest", str(uri), str(FILES[source]), "--from", source, "-q",
               "--score-with", str(model_dir), "--temperature", "0.7"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    store = RolloutStore.open(uri)
    rows = _rows(store)
    assert len(rows) == {"verl": 5, "trl": 4, "openai": 4}[source]
    assert all(r["logprobs_mode"] == "recomputed" and r["temperature"] == pytest.approx(0.7)
               for r in rows)  # fmt: skip

    # Groups: one per prompt (+ step), sample_index 0..n-1 within each, in file order.
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    assert len(by_group) == 2
    for members in by_group.values():
        assert sorted(m["sample_index"] for m in members) == list(range(len(members)))
        assert len({m["prompt_text"] for m in members}) == 1

    # Behaviour log-probs: teacher-forced under the stored sampling settings.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    r0 = rows[0]
    with torch.no_grad():
        want = teacher_forced_logprobs(model, r0["prompt_ids"], r0["completion_ids"], 0.7)
    np.testing.assert_allclose(r0["behavior_logprobs"], want.numpy(), rtol=1e-5, atol=1e-6)

    rewards = np.array([r["reward"] for r in rows], np.float64)
    groups = np.array([r["group_id"] for r in rows])
    adv = np.array([r["advantage"] for r in rows], np.float32)
    if source == "trl":  # TRL logs its own advantage: kept, reward = sum of reward functions
        assert sorted(rewards.tolist()) == pytest.approx([0.5, 1.0, 1.0, 1.5])
        assert json.loads(rows[0]["reward_info"]).keys() == {"accuracy_reward", "format_reward"}
        assert sorted(adv.tolist()) == pytest.approx([-0.866, 0.0, 0.0, 0.866])
    else:  # computed per group from the rewards (GRPO by default), never silently zero
        np.testing.assert_allclose(adv, group_advantages(rewards, groups), atol=1e-6)
        assert np.abs(adv).max() > 0.5
    if source == "verl":
        assert {r["policy_version"] for r in rows} == {2}  # step 3 sampled weights of step 2
        assert json.loads(rows[0]["metadata"])["answer"] in {"5", "14"}
        assert "acc" in json.loads(rows[0]["reward_info"])
    if source in ("trl", "openai"):  # chat messages rendered with the tokenizer's template
        q = "What is 1+1?" if source == "trl" else "What is 9-3?"
        assert f"<|user|>\n{q}\n<|assistant|>\n" in {r["prompt_text"] for r in rows}
        assert {r["completion_text"] for r in rows} >= {"1+1=2" if source == "trl" else "9-3=6"}
    if source == "openai":  # the system turn is part of the prompt; turns kept for export
        assert any(r["prompt_text"].startswith("<|system|>\nYou are good") for r in rows)
        out = tmp_path / "sft.jsonl"
        assert store_main(["export", str(uri), str(out), "--as", "sft", "-q"]) == 0
        sft = [json.loads(line) for line in out.read_text().splitlines()]
        assert {m["messages"][-1]["content"] for m in sft} == {"4+4=8", "9-3=6"}
        assert sft[0]["prompt"][-1]["role"] == "user"

    # Trainable: a replay batch carries ids, behaviour log-probs and advantages.
    ds = ReplayDataset(store, ReplayConfig(seed=0), batch_size=4, learner_version=3, steps=1,
                       record_usage=False)  # fmt: skip
    (batch,) = list(ds)
    mask = batch["loss_mask"].bool()
    assert mask.sum() == sum(len(r["completion_ids"]) for r in rows
                             if r["rollout_id"] in set(batch["rollout_ids"]))  # fmt: skip
    assert (batch["behavior_logprobs"][mask] < 0).all()
    assert batch["advantages"][mask].abs().sum() > 0
    # ... and the learner trains on it: the recomputed behaviour log-probs are accepted
    # (they are reproducible) and, scored by the same weights, give ratio 1 at step one.
    model, _ = load_model(model_dir)
    learner = Learner(model, LossConfig(), OptimConfig(lr=1e-3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = learner.step(batch)
    assert abs(m["approx_kl"]) < 1e-4 and m["clip_frac_low"] == m["clip_frac_high"] == 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_grpo_needs_rewards_and_none_stores_null(tmp_path, model_dir, capsys):
    f = tmp_path / "chat.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(
                {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )  # fmt: skip
            for q, a in [("What is 1+1?", "2"), ("What is 1+1?", "3")]
        )
        + "\n"
    )
    uri = tmp_path / "store"
    args = ["ingest", str(uri), str(f), "--from", "openai", "-q", "--score-with", str(model_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{f}:1" in err and "reward" in err and "--advantages none" in err
    assert not uri.exists()  # a refused ingest creates no store

    assert main([*args, "--advantages", "none"]) == 0
    assert "2 rows have no advantage" in capsys.readouterr().err
    rows = _rows(RolloutStore.open(uri))
    assert [r["advantage"] for r in rows] == [None, None]


def test_unknown_fields_refused_unless_ignored(tmp_path, model_dir, capsys):
    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    f.write_text(json.dumps({"messages": msgs, "reward": 1.0, "source": "x"}) + "\n")
    uri = tmp_path / "store"
    args = ["ingest", str(uri), str(f), "--from", "openai", "-q", "--score-with", str(model_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "source" in err and "--ignore-unknown" in err
    assert main([*args, "--ignore-unknown"]) == 0
    assert RolloutStore.open(uri).count() == 1


def test_text_import_needs_score_with(tmp_path, capsys):
    rc = main(["ingest", str(tmp_path / "s"), str(FILES["verl"]), "--from", "verl", "-q"])
    assert rc == 2
    assert "--score-with MODEL_DIR" in capsys.readouterr().err
    rc = main(["ingest", str(tmp_path / "s"), str(FILES["verl"]), "--chat-template"])
    assert rc == 2
    assert "only apply with --from" in capsys.readouterr().err
    # The store's own CLI has no model: it names the command that has one.
    rc = store_main(["ingest", str(tmp_path / "s"), str(FILES["verl"]), "--from", "verl", "-q",
                     "--score-with", "M"])  # fmt: skip
    assert rc == 2 and "rolloutstore-train ingest" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
