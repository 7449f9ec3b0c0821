"""Re-scoring by a task's verifier (``task_scorer``, ``rolloutstore-train rescore``): new
rewards/advantages under a new reward_version, token columns untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from rolloutstore import RolloutStore
from rolloutstore.errors import QueryError, RolloutStoreError
from rolloutstore.replay import ReplayConfig, ReplayDataset, Selector
from rolloutstore.replay.selector import RewardVersionError
from rolloutstore.retention import rescore as rescore_mod
from trainer.algo.advantage import group_advantages
from trainer.cli import main
from trainer.store_commands import task_scorer
from trainer.tasks import ArithTask, RewardResult, get_task

COMPLETIONS = ("{a}", "{w}", "no idea", "<answer>{a}</answer>")


def arith_rows(n_prompts: int = 8, *, policy_version: int = 0, seed: int = 0) -> list[dict]:
    """Scored arith rollouts as trainer.rollout.pipeline writes them (answer in metadata)."""
    task = get_task("arith")
    rng = np.random.default_rng(seed)
    rows = []
    for p_i, p in enumerate(task.make_prompts(n_prompts, seed)):
        for j, form in enumerate(COMPLETIONS):
            text = form.format(a=p.answer, w=int(p.answer) + 1 + j)
            c = int(rng.integers(1, 12))
            res = task.reward(p, text)
            rows.append(
                {
                    "run_id": "r",
                    "group_id": f"g{policy_version}-{seed}-{p_i}",
                    "sample_index": j,
                    "policy_version": policy_version,
                    "prompt_ids": rng.integers(0, 500, size=5).tolist(),
                    "completion_ids": rng.integers(0, 500, size=c).tolist(),
                    "behavior_logprobs": (-rng.exponential(1.0, size=c)).tolist(),
                    "prompt_text": p.prompt_text,
                    "completion_text": text,
                    "reward": res.reward,
                    "reward_info": json.dumps(res.info),
                    "task": "arith",
                    "metadata": json.dumps({"answer": p.answer, "prompt_meta": p.meta}),
                }
            )
    adv = group_advantages([r["reward"] for r in rows], [r["group_id"] for r in rows])
    for r, a in zip(rows, adv):
        r["advantage"] = float(a)
    return rows


class FlippedArith(ArithTask):
    """A changed reward function: arith correctness, inverted."""

    def reward(self, prompt, completion_text):
        r = super().reward(prompt, completion_text)
        return RewardResult(1.0 - r.reward, {**r.info, "flipped": True})


class CrashingArith(ArithTask):
    """Fault injection: the verifier dies after ``after`` rows."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.calls = after, 0

    def reward(self, prompt, completion_text):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("verifier crashed")
        return super().reward(prompt, completion_text)


def _digest(path: Path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def _by_id(table, col: str) -> dict:
    return dict(zip(table["rollout_id"].to_pylist(), table[col].to_pylist()))


@pytest.fixture
def store(tmp_path):
    s = RolloutStore.open(tmp_path / "s")
    s.append(arith_rows(8, policy_version=0, seed=0))
    s.append(arith_rows(6, policy_version=1, seed=1))
    return s


def test_rescore_writes_a_new_version_and_never_touches_rollouts(store, tmp_path):
    rollouts_dir = tmp_path / "s" / "rollouts.lance"
    before_files, before_version = _digest(rollouts_dir), store.version
    orig = store.sql("SELECT rollout_id, group_id, reward FROM rollouts ORDER BY rollout_id")

    r1 = store.rescore(task_scorer(FlippedArith()), note="flip")
    assert (r1.rows, r1.groups, r1.reward_version) == (56, 14, 1)
    assert store.version == before_version and _digest(rollouts_dir) == before_files

    scored = store.sql(
        "SELECT rollout_id, group_id, reward, advantage, reward_version FROM rollouts_scored "
        "ORDER BY rollout_id"
    )
    old = np.asarray(orig["reward"].to_pylist())
    new = np.asarray(scored["reward"].to_pylist())
    np.testing.assert_array_equal(new, 1.0 - old)
    expect_adv = group_advantages(new, np.asarray(scored["group_id"].to_pylist()))
    np.testing.assert_allclose(scored["advantage"].to_pylist(), expect_adv, atol=1e-6)
    assert set(scored["reward_version"].to_pylist()) == {1}
    assert r1.mean_before == pytest.approx(old.mean()) and r1.mean_after == pytest.approx(
        new.mean()
    )
    assert r1.changed == int(np.sum(old != new))
    # The raw log still shows version 0.
    assert store.sql("SELECT reward FROM rollouts ORDER BY rollout_id").equals(
        orig.select(["reward"])
    )

    r2 = store.rescore(task_scorer("arith"))
    assert r2.reward_version == 2 and _digest(rollouts_dir) == before_files
    now = store.sql("SELECT rollout_id, reward, reward_version FROM rollouts_scored")
    assert set(now["reward_version"].to_pylist()) == {2}
    assert _by_id(now, "reward") == _by_id(orig, "reward")
    v1 = store.sql("SELECT rollout_id, reward, note FROM rewards WHERE reward_version = ?", [1])
    assert _by_id(v1, "reward") == {k: 1.0 - v for k, v in _by_id(orig, "reward").items()}
    assert set(v1["note"].to_pylist()) == {"flip"}


def test_selector_and_loader_read_the_chosen_reward_version(store):
    orig = _by_id(store.sql("SELECT rollout_id, reward FROM rollouts"), "reward")
    store.rescore(task_scorer(FlippedArith()))
    n = store.count()

    sel = Selector(store, ReplayConfig(seed=1), record_usage=False).sample(n, 1)
    got = dict(zip(sel.rollout_ids, sel.rewards.tolist()))
    assert got == {k: 1.0 - v for k, v in orig.items()}
    assert set(sel.reward_versions.tolist()) == {1}
    scored_adv = _by_id(store.sql("SELECT rollout_id, advantage FROM rollouts_scored"), "advantage")
    np.testing.assert_allclose(sel.advantages, [scored_adv[r] for r in sel.rollout_ids])

    old = Selector(store, ReplayConfig(seed=1, reward_version=0), record_usage=False).sample(n, 1)
    assert dict(zip(old.rollout_ids, old.rewards.tolist())) == orig

    # Filters run on the overlaid reward: only rows whose *new* reward is positive.
    pos = Selector(
        store, ReplayConfig(where="reward > ?", where_params=(0.5,)), record_usage=False
    ).candidates(1)
    assert sorted(pos["rollout_id"].to_pylist()) == sorted(k for k, v in orig.items() if v < 0.5)

    ds = ReplayDataset(store, ReplayConfig(seed=3), batch_size=16, steps=2, record_usage=False)
    for batch in ds:
        want = np.asarray([1.0 - orig[r] for r in batch["rollout_ids"]], np.float32)
        np.testing.assert_array_equal(batch["rewards"].numpy(), want)
        adv = np.asarray([scored_adv[r] for r in batch["rollout_ids"]], np.float32)
        np.testing.assert_allclose(batch["seq_advantages"].numpy(), adv)
        mask = batch["loss_mask"].bool()
        per_tok = batch["advantages"][mask]
        rows = mask.nonzero()[:, 0].numpy()
        np.testing.assert_allclose(per_tok.numpy(), adv[rows])

    with pytest.raises(RewardVersionError, match="reward_version 5 does not exist"):
        Selector(store, ReplayConfig(reward_version=5), record_usage=False).sample(4, 1)


def test_where_picks_whole_groups(store):
    r = store.rescore(
        task_scorer(FlippedArith()), where="policy_version = ? AND sample_index = ?", params=[1, 2]
    )
    assert (r.rows, r.groups) == (24, 6)
    t = store.sql("SELECT policy_version, reward_version FROM rollouts_scored")
    pairs = set(zip(t["policy_version"].to_pylist(), t["reward_version"].to_pylist()))
    assert pairs == {(0, 0), (1, 1)}
    # The filter reads the current (re-scored) reward.
    again = store.rescore(
        task_scorer("arith"), where="reward_version = ? AND reward > ?", params=[1, 0.5]
    )
    assert again.rows == 24 and again.reward_version == 2


@pytest.mark.parametrize(
    ("task", "options", "kwargs", "error", "match"),
    [
        ("nosuch", {}, {}, rescore_mod.RescoreError, "unknown task 'nosuch'"),
        ("arith", {"bogus": 1}, {}, rescore_mod.RescoreError, "bogus"),
        ("arith", {}, {"where": "reward > 0; DROP TABLE x"}, QueryError, "';'"),
        ("arith", {}, {"where": "no_such_column > ?", "params": [1]}, RolloutStoreError, "no_such_column"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_and_writes_nothing(
    store, tmp_path, task, options, kwargs, error, match
):
    with pytest.raises(error, match=match):
        store.rescore(task_scorer(task, options), **kwargs)
    assert not (tmp_path / "s" / "rewards.lance").exists()
    assert store.sql("SELECT count(*) AS n FROM rewards")["n"][0].as_py() == 0


def test_row_without_answer_is_named_and_nothing_is_written(store, tmp_path):
    bad = arith_rows(1, policy_version=2, seed=9)
    for r in bad:
        r["metadata"] = None
    store.append(bad)
    with pytest.raises(rescore_mod.RescoreError, match="no 'answer'"):
        store.rescore(task_scorer("arith"))
    assert store.sql("SELECT count(*) AS n FROM rewards")["n"][0].as_py() == 0


def test_a_task_needs_task_scorer(store, tmp_path):
    for task in ("arith", FlippedArith()):
        with pytest.raises(rescore_mod.RescoreError, match="task_scorer"):
            store.rescore(task)
    assert not (tmp_path / "s" / "rewards.lance").exists()


def test_crash_mid_rescore_leaves_no_partial_version(store, monkeypatch):
    store.rescore(task_scorer(FlippedArith()))
    v1 = store.sql("SELECT rollout_id, reward FROM rollouts_scored ORDER BY rollout_id")
    monkeypatch.setattr(rescore_mod, "BATCH_ROWS", 8)  # fragments get written before the crash
    task = CrashingArith(after=30)
    with pytest.raises(RuntimeError, match="verifier crashed"):
        store.rescore(task_scorer(task))
    assert task.calls == 31
    versions = store.sql("SELECT DISTINCT reward_version AS v FROM rewards")["v"].to_pylist()
    assert versions == [1]
    assert store.sql("SELECT rollout_id, reward FROM rollouts_scored ORDER BY rollout_id").equals(
        v1
    )
    assert store.rescore(task_scorer("arith")).reward_version == 2


def test_cli_rescore_with_task_options(store, capsys):
    ids_no_number = store.sql("SELECT rollout_id FROM rollouts WHERE completion_text = 'no idea'")
    rc = main(
        ["rescore", store.uri, "--task", "arith", "--task-option", "no_number_penalty=1", "-q"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "as reward_version 1" in out
    t = store.sql("SELECT rollout_id, reward FROM rollouts_scored")
    rewards = _by_id(t, "reward")
    assert {rewards[r] for r in ids_no_number["rollout_id"].to_pylist()} == {-1.0}
    mean = float(np.mean(t["reward"].to_pylist()))
    assert f"-> {mean:.4f}" in out

    rc = main(["rescore", store.uri, "--task", "nosuch", "-q"])
    assert rc == 2 and "unknown task 'nosuch'" in capsys.readouterr().err
    rc = main(["rescore", store.uri, "--task", "arith", "--where", "x) OR (1=1", "-q"])
    assert rc == 2 and "error:" in capsys.readouterr().err
    assert store.sql("SELECT max(reward_version) AS v FROM rewards")["v"][0].as_py() == 1


class NothingCorrect(ArithTask):
    """A stricter reward function under which no stored answer is correct."""

    def reward(self, prompt, completion_text):
        return RewardResult(0.0, {})


def test_diversity_eviction_judges_correct_answers_by_the_newest_rewards(store):
    from rolloutstore.retention.policy import RetentionConfig

    cfg = RetentionConfig(correct_threshold=0.5)
    q = "SELECT count(DISTINCT prompt_id) AS n FROM rollouts WHERE reward > 0.5"
    correct = store.sql(q)["n"][0].as_py()
    before = store.evict(keep_last=store.count(), preserve_diversity=cfg).coverage.before
    assert correct > 0 and before.total["correct"] == correct
    store.rescore(task_scorer(NothingCorrect()))
    report = store.evict(keep_last=20, preserve_diversity=cfg).coverage
    assert report.before.total["correct"] == 0  # the re-scoring, not the stored column
    assert store.count() == 20
