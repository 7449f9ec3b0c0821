from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from rolloutstore import RolloutStore
from rolloutstore.cli import main
from rolloutstore.retention.policy import RetentionConfig, plan_retention, read_rows

DIM = 8
VERSIONS, PER_VERSION, KEEP = 5, 120, 200
RARE = "p35-v0-correct"  # the only correct rollout of hard prompt 35, in the oldest version


def skewed_rows(*, embeddings: bool = True) -> list[dict]:
    """Old versions spread over 40 prompts in 8 embedding clusters; the newest two versions
    only sample 4 prompts of 2 clusters. Prompts 32-39 are hard: no correct answer except
    one for prompt 35."""
    rng = np.random.default_rng(0)
    centres = np.eye(DIM, dtype=np.float32)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rows = []
    for v in range(VERSIONS):
        for j in range(PER_VERSION):
            p = int(rng.integers(40)) if v < 3 else int(rng.choice([0, 1, 8, 9]))
            rid = f"r{v}-{j:04d}"
            reward = float(rng.random() < 0.5) if p < 32 else 0.0
            if v == 0 and j == 0:
                p, rid, reward = 35, RARE, 1.0
            emb = centres[p % 8] + 0.05 * rng.standard_normal(DIM).astype(np.float32)
            rows.append(
                {
                    "rollout_id": rid,
                    "prompt_id": f"p{p}",
                    "group_id": f"g{v}-{j // 4}",
                    "policy_version": v,
                    "created_at": t0 + timedelta(seconds=len(rows)),
                    "prompt_ids": [p + 1],
                    "completion_ids": [1, 2],
                    "behavior_logprobs": [-0.5, -0.25],
                    "reward": reward,
                    "embedding": emb.tolist() if embeddings else None,
                }
            )
    return rows


def _store(path, rows) -> RolloutStore:
    s = RolloutStore.open(path, embedding_dim=DIM)
    s.append(rows)
    return s


def _newest_first(rows) -> list[str]:
    key = lambda r: (r["policy_version"], r["created_at"], r["rollout_id"])  # noqa: E731
    return [r["rollout_id"] for r in sorted(rows, key=key, reverse=True)]


def _left(store) -> set[str]:
    return set(store.sql("SELECT rollout_id FROM rollouts")["rollout_id"].to_pylist())


def test_preserve_diversity_covers_more_than_fifo_with_the_same_rows(tmp_path):
    rows = skewed_rows()
    by_id = {r["rollout_id"]: r for r in rows}
    store = _store(tmp_path / "s", rows)
    fifo = set(_newest_first(rows)[:KEEP])

    res = store.evict(keep_last=KEEP, preserve_diversity=True)

    kept = _left(store)
    assert res.rows_left == store.count() == KEEP and res.rows_deleted == len(rows) - KEEP
    assert len(store.checkout(res.version - 1).dataset().to_table()) == len(rows)  # one commit

    def covered(ids):
        prompts = {by_id[i]["prompt_id"] for i in ids}
        clusters = {int(np.argmax(by_id[i]["embedding"])) for i in ids}
        correct = {by_id[i]["prompt_id"] for i in ids if by_id[i]["reward"] > 0}
        return len(prompts), len(clusters), len(correct)

    got, base = covered(kept), covered(fifo)
    assert got[0] > 2 * base[0] and got[1] == 8 > base[1] and got[2] > 2 * base[2]
    # The report counts what is really left, and what FIFO would have left.
    rep = res.coverage
    assert (rep.kept.covered["prompts"], rep.kept.covered["correct"]) == (got[0], got[2])
    assert (rep.fifo.covered["prompts"], rep.fifo.covered["correct"]) == (base[0], base[2])
    assert rep.kept.combined > rep.fifo.combined and rep.before.combined == 1.0


def test_the_newest_rows_and_a_rare_correct_answer_are_kept(tmp_path):
    rows = skewed_rows()
    store = _store(tmp_path / "s", rows)
    order = _newest_first(rows)
    assert RARE not in order[:KEEP]  # FIFO would drop it
    res = store.evict(keep_last=KEEP, preserve_diversity=RetentionConfig(reserve=0.2))
    kept = _left(store)
    newest = int(KEEP * 0.8)
    assert res.coverage.newest == newest
    assert set(order[:newest]) <= kept
    assert RARE in kept


def test_same_store_same_config_same_rows_kept(tmp_path):
    rows = skewed_rows()
    cfg = RetentionConfig(seed=3, clusters=6)
    a, b = _store(tmp_path / "a", rows), _store(tmp_path / "b", list(reversed(rows)))
    ra = a.evict(keep_last=150, preserve_diversity=cfg)
    rb = b.evict(keep_last=150, preserve_diversity=cfg)
    assert _left(a) == _left(b)
    assert ra.coverage == rb.coverage


def test_other_rules_still_apply_and_keep_counts_what_they_leave(tmp_path):
    store = _store(tmp_path / "s", skewed_rows())
    res = store.evict(keep_last=150, min_policy_version=1, preserve_diversity=True)
    assert store.count() == 150 == res.rows_left
    assert store.sql("SELECT min(policy_version) AS v FROM rollouts")["v"].to_pylist() == [1]
    assert RARE not in _left(store)  # an explicit rule wins over diversity


def test_rows_appended_after_the_plan_are_never_deleted(tmp_path):
    store = _store(tmp_path / "s", skewed_rows())
    ds = store.dataset()
    plan = plan_retention(read_rows(ds), KEEP)
    late = skewed_rows()[:7]
    for i, r in enumerate(late):
        r["rollout_id"], r["policy_version"] = f"late{i}", 9
    store.append(late)
    ds.delete(plan.delete)  # the filter computed before the append
    assert store.count() == KEEP + 7
    assert {f"late{i}" for i in range(7)} <= _left(store)


def test_store_without_embeddings_is_judged_on_prompts_and_answers(tmp_path):
    store = _store(tmp_path / "s", skewed_rows(embeddings=False))
    res = store.evict(keep_last=KEEP, preserve_diversity=True)
    rep = res.coverage
    assert rep.before.total["clusters"] == 0 and rep.kept.fraction("clusters") is None
    assert store.count() == KEEP
    assert rep.kept.covered["prompts"] > rep.fifo.covered["prompts"]


def test_keep_more_than_the_store_deletes_nothing(tmp_path):
    store = _store(tmp_path / "s", skewed_rows())
    v = store.version
    res = store.evict(keep_last=10_000, preserve_diversity=True)
    assert res.rows_deleted == 0 and store.version == v
    assert res.coverage.kept.combined == 1.0


def test_cli_prints_before_after_and_fifo_coverage(tmp_path, capsys):
    store = _store(tmp_path / "s", skewed_rows())
    argv = ["evict", store.uri, "--keep", str(KEEP), "--preserve-diversity", "--clusters", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"evicted {PER_VERSION * VERSIONS - KEEP} rollouts, {KEEP} left" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    prompts = len(set(store.sql("SELECT prompt_id FROM rollouts")["prompt_id"].to_pylist()))
    assert f"{prompts}/40" in lines["kept"] and "40/40" in lines["before"]
    assert "fifo would keep" in out and "x FIFO's" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preserve-diversity"], "--preserve-diversity needs --keep"),
        (["--keep", "5", "--preserve-diversity", "--reserve", "1.5"], "reserve must be in [0, 1]"),
        (["--keep", "-3", "--preserve-diversity"], "keep_last must be an int >= 0"),
        (["--keep", "5", "--reserve", "0.1"], "only apply with --preserve-diversity"),
    ],
)
def test_cli_bad_arguments_say_what_to_fix(tmp_path, capsys, argv, message):
    store = _store(tmp_path / "s", skewed_rows()[:20])
    assert main(["evict", store.uri, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1
    assert store.count() == 20


def test_api_bad_arguments(store):
    with pytest.raises(ValueError, match="needs keep_last"):
        store.evict(min_policy_version=1, preserve_diversity=True)
    with pytest.raises(TypeError, match="RetentionConfig"):
        store.evict(keep_last=3, preserve_diversity="yes")
    with pytest.raises(ValueError, match="RetentionConfig.clusters"):
        RetentionConfig(clusters=0)
