"""Embedding diversity on stores where some or all rows carry no embedding (imported rows):
no duplicates without replacement, the rest drawn with prompt diversity, counted and warned."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import make_rows

from rolloutstore import ReplayConfig, RolloutStore, Selector
from rolloutstore.cli import main
from rolloutstore.errors import MissingEmbeddingWarning


def _store(tmp_path, with_embedding: int, without: int) -> RolloutStore:
    store = RolloutStore.open(tmp_path / "store", embedding_dim=4)
    rng = np.random.default_rng(0)
    rows = make_rows(with_embedding + without, seed=3, policy_version=5, group_size=8)
    for r in rows[:with_embedding]:
        r["embedding"] = rng.normal(size=4).astype(np.float32).tolist()
    store.append(rows)
    return store


@pytest.mark.parametrize("with_embedding, without", [(0, 64), (40, 60), (60, 4)])
def test_embedding_diversity_never_repeats_a_row_and_counts_rows_without(
    tmp_path, with_embedding, without
):
    store = _store(tmp_path, with_embedding, without)
    t = store.dataset().to_table()
    has = "embedding" in t.column_names  # a store whose rows never had one lacks the column
    missing = {r["rollout_id"] for r in t.to_pylist() if not has or r["embedding"] is None}
    sel = Selector(store, ReplayConfig(diversity="embedding", seed=1), record_usage=False)
    with pytest.warns(MissingEmbeddingWarning, match="no embedding"):
        s = sel.sample(32, learner_version=5)
    assert len(s) == 32 and len(set(s.rollout_ids)) == 32
    assert s.no_embedding == sum(i in missing for i in s.rollout_ids)
    if with_embedding and without:  # both kinds drawn, at about their share of the pool
        assert 0 < s.no_embedding < 32
    for _ in range(3):  # later draws too (the warning comes once per selector)
        s = sel.sample(32, learner_version=5)
        assert len(set(s.rollout_ids)) == 32


def test_embedding_diversity_with_every_embedding_counts_none(tmp_path):
    store = _store(tmp_path, 48, 0)
    s = Selector(store, ReplayConfig(diversity="embedding"), record_usage=False).sample(48, 5)
    assert len(set(s.rollout_ids)) == 48 and s.no_embedding == 0
    u = Selector(store, ReplayConfig(), record_usage=False).sample(8, 5)
    assert u.no_embedding is None


def test_cli_sample_embedding_diversity_on_imported_rows(tmp_path, capsys):
    store = _store(tmp_path, 10, 54)
    args = ["sample", str(store.uri), "--batch-size", "32", "--learner-version", "5"]
    assert main([*args, "--diversity", "embedding", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    ids = [json.loads(line)["rollout_id"] for line in out.splitlines()]
    assert len(ids) == 32 and len(set(ids)) == 32
    assert "warning:" in err and "have no embedding" in err


def test_loader_batches_carry_the_count_a_train_record_logs(tmp_path):
    from rolloutstore import ReplayDataset

    store = _store(tmp_path, 20, 44)
    cfg = ReplayConfig(diversity="embedding", seed=2)
    with pytest.warns(MissingEmbeddingWarning):
        batches = list(ReplayDataset(store, cfg, batch_size=32, learner_version=5, steps=3,
                                     record_usage=False))  # fmt: skip
    t = store.dataset().to_table(columns=["rollout_id", "embedding"]).to_pylist()
    missing = {r["rollout_id"] for r in t if r["embedding"] is None}
    for b in batches:
        assert len(set(b["rollout_ids"])) == 32
        assert b["no_embedding"] == sum(i in missing for i in b["rollout_ids"]) > 0
    (plain,) = ReplayDataset(store, ReplayConfig(), batch_size=4, learner_version=5, steps=1)
    assert plain["no_embedding"] is None
