"""ReplayGRPOTrainer: TRL's GRPOTrainer training from the store (tiny Qwen2 on CPU, ~1 minute).

One module-scoped run trains 4 steps (checkpoints at 2 and 4), then a second trainer resumes
from checkpoint-2 and trains to step 6, so the rows the first run appended after step 2 are
a retaken continuation that the resumed run must leave out.
"""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pytest
from helpers import require_trl

STEPS, RESUME_STEPS, ROWS, GROUP, STALENESS = 4, 6, 8, 4, 2


def _digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _trainer_class():
    require_trl()
    import torch

    from rolloutstore.integrations.trl import ReplayGRPOTrainer

    class Recording(ReplayGRPOTrainer):
        """Keeps each (global_step, selection, inputs dict) the loss received."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                tensors = {k: v.clone() for k, v in out.items() if torch.is_tensor(v)}
                self.batches.append((self.state.global_step, self.last_selection, tensors))
            return out

    return Recording


def _make(tmp, model, max_steps, *, store=None, args=None, **replay):
    from datasets import Dataset
    from trl import GRPOConfig

    from rolloutstore import ReplayConfig

    prompts = [f"Compute {a}+{b}. Answer:" for a in range(8) for b in range(4)]
    args = GRPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=ROWS, num_generations=GROUP,
        max_completion_length=8, max_steps=max_steps, save_steps=2, logging_steps=1,
        report_to=[], seed=0, learning_rate=1e-3, use_cpu=True, disable_tqdm=True, bf16=False,
        **(args or {}),
    )  # fmt: skip
    replay = {"window": 64, "max_staleness": STALENESS, "fresh_fraction": 0.5, **replay}
    cfg = ReplayConfig(seed=0, **replay)
    trainer = _trainer_class()(
        model=str(model), reward_funcs=_digits, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), store=store or tmp / "store",
        replay=cfg,
    )  # fmt: skip
    trainer.batches = []
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_trl()
    from rolloutstore import RolloutStore
    from trainer.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("trl")
    model = make_tiny_model(tmp / "tiny", task="arith")
    first = _make(tmp, model, STEPS)
    first.train()
    store = RolloutStore.open(tmp / "store")
    before_resume = store.sql("SELECT rollout_id, policy_version, created_at FROM rollouts")
    second = _make(tmp, model, RESUME_STEPS)
    second.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-2"))
    return {"tmp": tmp, "model": model, "first": first, "second": second, "store": store,
            "before_resume": before_resume}  # fmt: skip


def _rows(store, ids):
    t = store.sql(
        "SELECT rollout_id, policy_version, completion_ids, behavior_logprobs, advantage "
        "FROM rollouts WHERE list_contains(?, rollout_id)",
        [list(ids)],
    )
    return {r["rollout_id"]: r for r in t.to_pylist()}


def test_every_generated_batch_lands_in_the_store_as_grpo_groups(runs):
    t = runs["before_resume"]
    pv = np.asarray(t["policy_version"].to_pylist())
    assert sorted(np.unique(pv, return_counts=True)[1].tolist()) == [ROWS] * STEPS
    assert sorted(set(pv.tolist())) == list(range(STEPS))
    groups = (
        runs["store"]
        .sql(
            "SELECT group_id, count(*) AS n, count(DISTINCT prompt_id) AS prompts, "
            "list(sample_index ORDER BY sample_index) AS idx, sum(advantage) AS adv, "
            "bool_and(len(behavior_logprobs) = len(completion_ids)) AS aligned, "
            "min(logprobs_mode) AS mode FROM rollouts GROUP BY 1"
        )
        .to_pylist()
    )
    assert len(groups) == (ROWS // GROUP) * RESUME_STEPS + (ROWS // GROUP) * (STEPS - 2)
    for g in groups:
        assert (g["n"], g["prompts"], g["idx"]) == (GROUP, 1, list(range(GROUP)))
        assert abs(g["adv"]) < 1e-3  # TRL's group-normalised advantages
        assert g["aligned"] and g["mode"] == "trl_old_per_token_logps"


def test_behaviour_logprobs_are_the_generating_models(runs):
    """Rows of policy version 0 were sampled by the initial weights: recompute them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs["model"])).eval()
    rows = (
        runs["store"]
        .sql(
            "SELECT prompt_ids, completion_ids, behavior_logprobs, temperature FROM rollouts "
            "WHERE policy_version = 0 AND run_id = 'trl' ORDER BY created_at LIMIT ?",
            [ROWS],
        )
        .to_pylist()
    )
    assert len(rows) == ROWS
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1] / r["temperature"]
        want = torch.log_softmax(logits.float(), -1).gather(
            -1, torch.tensor(r["completion_ids"])[:, None]
        )[:, 0]
        np.testing.assert_allclose(r["behavior_logprobs"], want.numpy(), atol=2e-4)


def test_training_batches_mix_fresh_and_replayed_rows_within_the_staleness_bound(runs):
    store, batches = runs["store"], runs["first"].batches
    assert [step for step, _, _ in batches] == list(range(STEPS))
    replayed = 0
    for step, sel, inputs in batches:
        rows = _rows(store, sel.rollout_ids)
        pv = np.asarray([rows[r]["policy_version"] for r in sel.rollout_ids])
        assert (step - pv).max() <= STALENESS and (step - pv).min() >= 0
        assert (pv == step).sum() == (ROWS if step == 0 else ROWS // 2)  # fresh_fraction 0.5
        replayed += int((pv < step).sum())
        # The inputs dict TRL's loss reads is exactly the stored rows, padded as TRL pads.
        mask = inputs["completion_mask"].bool()
        for i, rid in enumerate(sel.rollout_ids):
            row, n = rows[rid], int(mask[i].sum())
            assert inputs["completion_ids"][i, :n].tolist() == row["completion_ids"]
            np.testing.assert_allclose(
                inputs["old_per_token_logps"][i, :n].numpy(), row["behavior_logprobs"], rtol=1e-6
            )
            assert inputs["advantages"][i].item() == pytest.approx(row["advantage"])
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()]
            assert inputs["prompt_mask"][i, -1] == 1  # left padding
            assert len(prompt) > 0
    assert replayed == (STEPS - 1) * (ROWS // 2)
    # Rows of version 0 are still in the store and the window at step 3, but too stale.
    last = batches[-1][1]
    assert 0 not in set(last.policy_version.tolist()) and STEPS - 1 - 0 > STALENESS


def test_resume_continues_versions_without_duplicates_or_the_retaken_rows(runs):
    store, second, tmp = runs["store"], runs["second"], runs["tmp"]
    state = json.loads((tmp / "out" / "checkpoint-2" / "rolloutstore_state.json").read_text())
    assert state["global_step"] == 2 and state["selector"]["step"] == 2
    saved_at = datetime.fromisoformat(state["saved_at"])
    old = runs["before_resume"].to_pylist()
    orphans = {r["rollout_id"] for r in old if r["created_at"] > saved_at}
    assert {r["policy_version"] for r in old if r["rollout_id"] in orphans} == {2, 3}
    assert len(orphans) == 2 * ROWS
    # The resumed trainer generated at the steps it retook and went on, appending once each.
    assert [step for step, _, _ in second.batches] == list(range(2, RESUME_STEPS))
    ids = store.sql("SELECT rollout_id, policy_version FROM rollouts").to_pylist()
    assert len(ids) == len({r["rollout_id"] for r in ids}) == ROWS * (STEPS + RESUME_STEPS - 2)
    old_ids = {r["rollout_id"] for r in old}
    new_versions = sorted(r["policy_version"] for r in ids if r["rollout_id"] not in old_ids)
    assert new_versions == sorted(list(range(2, RESUME_STEPS)) * ROWS)
    drawn = {rid for _, sel, _ in second.batches for rid in sel.rollout_ids}
    assert drawn.isdisjoint(orphans)
    # ... while rows from before the checkpoint are replayed after the resume.
    assert drawn & (old_ids - orphans)
    for step, sel, _ in second.batches:
        assert sel.step == step and (sel.staleness <= STALENESS).all()


@pytest.mark.parametrize(
    "args,replay,match",
    [
        ({}, {"window": 4}, r"window=4 is smaller than one generation batch \(8"),
        ({"beta": 0.1}, {}, r"beta=0.1 \(no reference model"),
    ],
    ids=["window", "beta"],
)
def test_a_refused_trainer_creates_no_store(runs, tmp_path, args, replay, match):
    from rolloutstore.errors import UsageError

    with pytest.raises(UsageError, match=match):
        _make(tmp_path, runs["model"], 1, args=args, **replay)
    assert not (tmp_path / "store").exists()


DAMAGED = {
    "not json": lambda s: "{" + s[:20],
    "a list": lambda s: "[1, 2]",
    "no selector": lambda s: json.dumps(
        {k: v for k, v in json.loads(s).items() if k != "selector"}
    ),
    "step a str": lambda s: json.dumps({**json.loads(s), "selector": {"step": "2"}}),
    "saved_at not a time": lambda s: json.dumps({**json.loads(s), "saved_at": "yesterday"}),
    "orphans": lambda s: json.dumps({**json.loads(s), "orphans": [["2024-01-01"]]}),
    "store_version null": lambda s: json.dumps({**json.loads(s), "store_version": None}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_state_file_is_named(runs, tmp_path, damage):
    from rolloutstore.errors import ResumeStateError
    from rolloutstore.integrations.trl import STATE_FILE, read_state

    good = (runs["tmp"] / "out" / "checkpoint-2" / STATE_FILE).read_text()
    assert read_state(runs["tmp"] / "out" / "checkpoint-2" / STATE_FILE)["run_id"] == "trl"
    path = tmp_path / STATE_FILE
    path.write_text(DAMAGED[damage](good))
    with pytest.raises(ResumeStateError) as exc:
        read_state(path)
    assert str(exc.value).startswith(f"{path} is damaged: expected") or "as JSON" in str(exc.value)
    assert "\n" not in str(exc.value)


def _resume_copy(runs, tmp, edit=None):
    """A copy of checkpoint-2 in ``tmp/out``, its state file edited by ``edit``."""
    import shutil

    from rolloutstore.integrations.trl import STATE_FILE

    ckpt = tmp / "out" / "checkpoint-2"
    shutil.copytree(runs["tmp"] / "out" / "checkpoint-2", ckpt)
    state = json.loads((ckpt / STATE_FILE).read_text())
    (ckpt / STATE_FILE).write_text(edit(state) if edit else json.dumps(state))
    return str(ckpt)


def test_resume_refuses_a_damaged_state_file_another_store_or_an_older_store(runs, tmp_path):
    """Each refused before the first resumed step: the run's store is left as it was."""
    from rolloutstore import RolloutStore
    from rolloutstore.errors import ResumeStateError

    store = runs["store"]
    before = RolloutStore.open(store.uri).version
    ckpt = _resume_copy(runs, tmp_path / "damaged", lambda s: "{")
    trainer = _make(tmp_path / "damaged", runs["model"], RESUME_STEPS, store=store.uri)
    with pytest.raises(ResumeStateError, match=r"rolloutstore_state.json is damaged: it does not"):
        trainer.train(resume_from_checkpoint=ckpt)

    ckpt = _resume_copy(runs, tmp_path / "other")
    trainer = _make(tmp_path / "other", runs["model"], RESUME_STEPS)  # a new store
    with pytest.raises(ResumeStateError) as exc:
        trainer.train(resume_from_checkpoint=ckpt)
    assert f"was saved training from the store {store.uri!r}" in str(exc.value)
    assert f"pass store={store.uri!r}" in str(exc.value)

    # A new store where the checkpoint's was (here: the state names the new one's path).
    fresh = tmp_path / "fresh" / "store"
    ckpt = _resume_copy(
        runs, tmp_path / "fresh", lambda s: json.dumps({**s, "store_uri": str(fresh)})
    )
    trainer = _make(tmp_path / "fresh", runs["model"], RESUME_STEPS)
    with pytest.raises(
        ResumeStateError, match=r"was saved at store version \d+, the store .* is at"
    ):
        trainer.train(resume_from_checkpoint=ckpt)
    assert RolloutStore.open(store.uri).version == before
    assert not trainer.batches
