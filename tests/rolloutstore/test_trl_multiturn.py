"""ReplayGRPOTrainer with multi-turn rollouts: TRL's ``tool_mask`` in and out of the store.

A ``rollout_func`` (TRL's hook for custom rollouts) samples 3 tokens with the trainer's
model, appends a fixed "tool reply" (``env_mask`` 0), and samples 3 more: every trajectory
is assistant / tool / assistant. Tiny Qwen2 on CPU, 3 steps, ~30 s.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import require_trl

STEPS, ROWS, GROUP, SEG = 3, 8, 4, 3


def _digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _rollout_func(env_ids):
    import torch

    def rollout(prompts, trainer):
        tok, model = trainer.processing_class, trainer.model
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for p in prompts:  # TRL's sampler already repeats each prompt num_generations times
            prompt = tok(p)["input_ids"]
            seq, mask = list(prompt), []
            for segment in range(2):
                with torch.no_grad():
                    gen = model.generate(
                        torch.tensor([seq]), do_sample=True, max_new_tokens=SEG,
                        min_new_tokens=SEG, pad_token_id=tok.pad_token_id,
                    )  # fmt: skip
                seq += gen[0, len(seq) :].tolist()
                mask += [1] * SEG
                if segment == 0:
                    seq += env_ids
                    mask += [0] * len(env_ids)
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(seq[len(prompt) :])
            out["logprobs"].append([0.0] * len(mask))
            out["env_mask"].append(mask)
        return out

    return rollout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    require_trl()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from rolloutstore import ReplayConfig, RolloutStore
    from rolloutstore.integrations.trl import ReplayGRPOTrainer
    from trainer.models.tiny import make_tiny_model

    class Recording(ReplayGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self.batches.append(
                    (
                        self.last_selection,
                        {k: v.clone() for k, v in out.items() if torch.is_tensor(v)},
                    )
                )
            return out

    tmp = tmp_path_factory.mktemp("trl_mt")
    model = make_tiny_model(tmp / "tiny", task="arith")
    env_ids = AutoTokenizer.from_pretrained(str(model))(" =7 ")["input_ids"]
    args = GRPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=ROWS, num_generations=GROUP,
        max_completion_length=2 * SEG + len(env_ids), max_steps=STEPS, save_strategy="no",
        report_to=[], seed=0, learning_rate=1e-3, use_cpu=True, disable_tqdm=True, bf16=False,
    )  # fmt: skip
    prompts = [f"Compute {a}+{b}. Answer:" for a in range(8) for b in range(4)]
    trainer = Recording(
        model=str(model), reward_funcs=_digits, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), store=tmp / "store",
        replay=ReplayConfig(seed=0, window=64, max_staleness=2, fresh_fraction=0.5),
        rollout_func=_rollout_func(env_ids),
    )  # fmt: skip
    trainer.batches = []
    trainer.train()
    return {"trainer": trainer, "model": model, "env": env_ids,
            "store": RolloutStore.open(tmp / "store")}  # fmt: skip


def _mask(env):
    return [1] * SEG + [0] * len(env) + [1] * SEG


def test_trajectories_land_with_their_mask_turns_and_no_logprob_on_tool_tokens(run):
    rows = (
        run["store"]
        .sql(
            "SELECT completion_ids, loss_mask, turns, behavior_logprobs, num_turns, "
            "num_model_tokens, num_tool_calls FROM rollouts"
        )
        .to_pylist()
    )
    env = run["env"]
    assert len(rows) == ROWS * STEPS
    want = [("assistant", 0, SEG), ("tool", SEG, SEG + len(env)),
            ("assistant", SEG + len(env), 2 * SEG + len(env))]  # fmt: skip
    for r in rows:
        assert r["loss_mask"] == _mask(env)
        assert r["completion_ids"][SEG : SEG + len(env)] == env
        assert [(t["role"], t["start"], t["end"]) for t in r["turns"]] == want
        assert (r["num_turns"], r["num_model_tokens"], r["num_tool_calls"]) == (3, 2 * SEG, 1)
        lp = np.asarray(r["behavior_logprobs"])
        assert (lp[SEG : SEG + len(env)] == 0).all()
        assert (lp[:SEG] < 0).all() and (lp[-SEG:] < 0).all()


def test_replayed_trajectories_reach_trls_loss_with_their_tool_mask(run):
    trainer, env = run["trainer"], run["env"]
    assert len(trainer.batches) == STEPS
    replayed = 0
    for step, (sel, inputs) in enumerate(trainer.batches):
        replayed += int((sel.policy_version < step).sum())
        tool_mask, completion = inputs["tool_mask"], inputs["completion_mask"]
        for i in range(len(sel)):
            n = int(completion[i].sum())
            assert tool_mask[i, :n].tolist() == _mask(env)
        assert int(inputs["num_items_in_batch"]) == int((tool_mask * completion).sum())
    assert replayed == (STEPS - 1) * (ROWS // 2)
    # TRL's loss ignores the tool tokens: changing their old log-probs changes nothing...
    inputs = dict(trainer.batches[-1][1])
    base = trainer.compute_loss(trainer.model, inputs).item()
    moved = dict(inputs, old_per_token_logps=inputs["old_per_token_logps"].clone())
    moved["old_per_token_logps"][inputs["tool_mask"] == 0] = -5.0
    assert trainer.compute_loss(trainer.model, moved).item() == pytest.approx(base, abs=1e-7)
    # ... which it would not without the mask (so the check above can fail).
    unmasked = {k: v for k, v in moved.items() if k != "tool_mask"}
    assert trainer.compute_loss(trainer.model, unmasked).item() != pytest.approx(base, abs=1e-4)
