"""ReplayDataset: tensors line up with the stored rows; ranks, workers, resume, long sequences."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.io.proxy import proxy_batches
from rolloutstore.replay import collate as C
from rolloutstore.replay.loader import micro_batches


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.open(tmp_path_factory.mktemp("ld") / "store", embedding_dim=8)
    for v in range(4):
        s.append(
            proxy_batches(
                96,
                seed=v,
                start_index=96 * v,
                rollouts_per_version=96,
                mean_completion_tokens=20,
                prompt_tokens=(3, 9),
                embedding_dim=8,
                batch_rollouts=96,
            )
        )
    return s.checkout(s.version)


def _rows(store, ids):
    t = store.sql("SELECT * FROM rollouts WHERE list_contains(?, rollout_id)", [ids]).to_pylist()
    by_id = {r["rollout_id"]: r for r in t}
    return [by_id[i] for i in ids]


def _batches(store, n, **kw):
    kw.setdefault("record_usage", False)
    ds = ReplayDataset(store, kw.pop("config", ReplayConfig(seed=7)), steps=n, **kw)
    return list(ds)


def test_padded_batch_lines_up_with_stored_rows(store):
    (b,) = _batches(store, 1, batch_size=6, learner_version=5)
    assert b["input_ids"].shape[0] == 6 and b["loss_mask"].shape[1] == b["input_ids"].shape[1] - 1
    for i, r in enumerate(_rows(store, b["rollout_ids"])):
        p, c, lp = r["prompt_ids"], r["completion_ids"], r["behavior_logprobs"]
        n = len(p) + len(c)
        assert b["input_ids"][i, :n].tolist() == p + c
        assert b["attention_mask"][i].sum() == n and b["input_ids"][i, n:].eq(0).all()
        # Column t scores token t+1: completion token j is scored at column len(p) - 1 + j.
        cols = torch.nonzero(b["loss_mask"][i]).flatten().tolist()
        assert cols == list(range(len(p) - 1, len(p) - 1 + len(c)))
        assert np.array_equal(b["behavior_logprobs"][i, cols].numpy(), np.float32(lp))
        assert torch.all(b["advantages"][i, cols] == np.float32(r["advantage"]))
        assert b["staleness"][i] == 5 - r["policy_version"]


def test_packed_equals_padded(store):
    (pad,) = _batches(store, 1, batch_size=5, learner_version=5)
    (pk,) = _batches(store, 1, batch_size=5, learner_version=5, pack=True)
    assert pk["rollout_ids"] == pad["rollout_ids"]
    cu = pk["cu_seqlens"].tolist()
    for i in range(5):
        n = cu[i + 1] - cu[i]
        assert pk["input_ids"][0, cu[i] : cu[i + 1]].tolist() == pad["input_ids"][i, :n].tolist()
        assert pk["position_ids"][0, cu[i] : cu[i + 1]].tolist() == list(range(n))
        seg = slice(cu[i], cu[i + 1] - 1)
        assert torch.equal(pk["loss_mask"][0, seg], pad["loss_mask"][i, : n - 1])
        assert torch.equal(pk["behavior_logprobs"][0, seg], pad["behavior_logprobs"][i, : n - 1])
    # The position predicting a sequence's first token from the previous one is masked.
    assert all(pk["loss_mask"][0, c - 1] == 0 for c in cu[1:-1])
    assert pk["loss_mask"].sum() == pad["loss_mask"].sum()


def test_batches_hold_exactly_the_declared_keys_in_their_shapes(store):
    (pad,) = _batches(store, 1, batch_size=6, learner_version=5)
    (pk,) = _batches(store, 1, batch_size=6, learner_version=5, pack=True)
    (mbs,) = _batches(store, 1, batch_size=6, micro_batch_tokens=60, learner_version=5)
    base = {*C.TOKEN_KEYS, *C.TARGET_KEYS, *C.SEQUENCE_KEYS, *C.BATCH_INFO_KEYS}
    assert set(pad) == base and set(pk) == base | set(C.PACKED_KEYS)
    assert all(set(m) == base | set(C.MICRO_BATCH_KEYS) for m in mbs)
    for b, rows in ((pad, 6), (pk, 1)):
        width = b["input_ids"].shape[1]
        assert all(b[k].shape == (rows, width) for k in C.TOKEN_KEYS)
        assert all(b[k].shape == (rows, width - 1) for k in C.TARGET_KEYS)
        assert all(b[k].shape == (6,) for k in C.SEQUENCE_KEYS)


def test_token_budget_and_micro_batches(store):
    bs = _batches(store, 3, max_tokens_per_batch=400, pack=True, learner_version=5)
    assert all(b["num_tokens"] <= 400 for b in bs)
    (mbs,) = _batches(store, 1, batch_size=16, micro_batch_tokens=120, learner_version=5)
    assert sum(len(m["rollout_ids"]) for m in mbs) == 16
    assert all(m["num_tokens"] <= 120 or len(m["rollout_ids"]) == 1 for m in mbs)
    assert all(m["step_loss_tokens"] == sum(x["num_loss_tokens"] for x in mbs) for m in mbs)
    assert [len(g) for g in micro_batches(np.array([5, 5, 20, 1, 1]), 10)] == [2, 1, 2]


def test_ranks_are_disjoint_and_cover_the_selection(store):
    cfg = ReplayConfig(seed=3)
    full = _batches(store, 3, batch_size=12, learner_version=5, config=cfg)
    shards = [
        _batches(store, 3, batch_size=12, learner_version=5, config=cfg, rank=r, world_size=3)
        for r in range(3)
    ]
    for step in range(3):
        ids = [set(shards[r][step]["rollout_ids"]) for r in range(3)]
        assert not (ids[0] & ids[1] or ids[1] & ids[2] or ids[0] & ids[2])
        assert set().union(*ids) == set(full[step]["rollout_ids"])


@pytest.mark.parametrize("max_uses", [None, 1])
def test_dataloader_workers_give_the_same_stream(store, max_uses):
    """Workers draw only their own steps, or, under a use cap, replay every step's draw."""
    cfg = ReplayConfig(seed=9, max_uses=max_uses, window=24)  # the cap binds: 20 draws of 24
    ref = _batches(store, 5, batch_size=4, learner_version=5, config=cfg)
    ds = ReplayDataset(store, cfg, batch_size=4, learner_version=5, steps=5, record_usage=False)
    # Lance is not fork-safe: workers are spawned (as the loader's docstring says).
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = list(loader)
    assert [b["rollout_ids"] for b in got] == [b["rollout_ids"] for b in ref]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, ref))


def test_retarget_and_restart_draw_as_a_loader_built_that_way(store):
    kw = dict(batch_size=6, learner_version=5, steps=5, record_usage=False, prefetch=2)
    old, new = ReplayConfig(seed=3), ReplayConfig(seed=3, fresh_fraction=0.5, window=150)
    ds = ReplayDataset(store.checkout(store.version - 1), old, **kw)
    it = iter(ds)
    head = [next(it)["rollout_ids"] for _ in range(2)]  # the prefetcher ran further ahead
    ds.retarget(store=store, config=new)
    tail = [b["rollout_ids"] for b in ds.restart(it)]
    ref_head = [
        b["rollout_ids"] for b in ReplayDataset(store.checkout(store.version - 1), old, **kw)
    ]
    ref_tail = ReplayDataset(store, new, **kw)
    ref_tail.load_state_dict({"step": 2})
    assert head == ref_head[:2] and tail == [b["rollout_ids"] for b in ref_tail]
    assert tail != ref_head[2:]  # the new config and store are what drew them
    with pytest.raises(ValueError, match="keeps the loader's seed"):
        ds.retarget(config=ReplayConfig(seed=4))


def test_pickles_as_uri_and_version(store):
    ds = ReplayDataset(
        store, ReplayConfig(seed=1), batch_size=3, learner_version=5, steps=2, record_usage=False
    )
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.store.uri == store.uri and clone.store.version == store.version
    assert [b["rollout_ids"] for b in clone] == [b["rollout_ids"] for b in ds]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stop=st.integers(0, 6), max_uses=st.sampled_from([None, 2]), pack=st.booleans())
def test_resume_equals_uninterrupted(tmp_path_factory, store, stop, max_uses, pack):
    # Usage is recorded (max_uses depends on it), so each example gets its own store copy.
    import shutil

    base = tmp_path_factory.mktemp("resume")
    shutil.copytree(store.uri, base / "ref")
    shutil.copytree(store.uri, base / "live")
    live = RolloutStore.open(base / "live")
    cfg = ReplayConfig(seed=5, max_uses=max_uses, window=200)
    kw = dict(batch_size=24, learner_version=lambda s: 4 + s // 3, pack=pack, steps=8)
    ref_store = RolloutStore.open(base / "ref")
    ref = [b["rollout_ids"] for b in ReplayDataset(ref_store, cfg, run_id="a", **kw)]

    first = ReplayDataset(live, cfg, run_id="a", **kw)
    it = iter(first)
    head = [next(it)["rollout_ids"] for _ in range(stop)]
    state = first.state_dict()
    del it  # the "crash": prefetched batches beyond `stop` are lost
    resumed = ReplayDataset(live, cfg, run_id="a", **kw)
    resumed.load_state_dict(state)
    tail = [b["rollout_ids"] for b in resumed]
    assert head + tail == ref
    if max_uses:
        uses = live.sql(
            "SELECT rollout_id, count(DISTINCT learner_step) AS n FROM usage "
            "WHERE run_id = 'a' GROUP BY 1"
        )["n"].to_pylist()
        assert max(uses) <= max_uses


def test_long_rollouts_stream(tmp_path):
    s = RolloutStore.open(tmp_path / "s", embedding_dim=8)
    n = 131_072
    rng = np.random.default_rng(0)
    rows = [
        {
            "prompt_ids": rng.integers(0, 1000, 64).tolist(),
            "completion_ids": rng.integers(0, 1000, n).tolist(),
            "behavior_logprobs": (-rng.random(n)).astype(np.float32).tolist(),
            "policy_version": 0,
            "reward": 1.0,
            "advantage": 0.5,
        }
        for _ in range(2)
    ]
    s.append(rows)
    (mbs,) = _batches(s, 1, batch_size=2, micro_batch_tokens=n, pack=True)
    assert [m["input_ids"].shape[1] for m in mbs] == [n + 64, n + 64]
    assert all(m["loss_mask"].sum() == n for m in mbs)
    got = mbs[0]["behavior_logprobs"][0, 63:].numpy()
    want = np.float32([r for r in rows if True][0]["behavior_logprobs"])
    assert np.array_equal(got, want) or np.array_equal(
        got, np.float32(rows[1]["behavior_logprobs"])
    )
