"""The fast fetch paths (issue [speed]) against straightforward references: the same rows, in
the same order, with the same values, on a store of several fragments with deleted rows and
rows whose token lists hold one token (append refuses empty ones), and an empty shard."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import make_rows, plain_selection
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore, Selector
from rolloutstore.replay.collate import TOKEN_COLUMNS, TokenRows, collate
from rolloutstore.replay.loader import TokenCache

COLS = TOKEN_COLUMNS + ["temperature"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.open(tmp_path_factory.mktemp("ff") / "store", embedding_dim=8)
    for v in range(4):  # one fragment per append
        rows = make_rows(40, seed=v, policy_version=v, run_id="ff")
        # Append refuses empty token lists, so the shortest rows hold one token each.
        rows[1]["prompt_ids"], rows[1]["completion_ids"] = [5], [7]  # size-1 lists
        rows[1]["behavior_logprobs"] = [-0.5]
        rows[2]["completion_ids"], rows[2]["behavior_logprobs"] = [9], [-0.25]
        s.append(rows)
    s.dataset().delete("sample_index = 3")  # deleted rows in every fragment
    s = RolloutStore.open(s.uri, create=False)
    assert len(s.dataset().get_fragments()) == 4
    return s.checkout(s.version)


def _by_address(store) -> dict[int, dict]:
    t = store.dataset().to_table(columns=["rollout_id", *COLS], with_row_address=True)
    return {r["_rowaddr"]: r for r in t.to_pylist()}


def _reference_rows(ref: dict[int, dict], addresses) -> list[dict]:
    out = []
    for a in addresses:
        r = dict(ref[int(a)])
        if r["loss_mask"] is None:  # stored as null: one 1 per completion token
            r["loss_mask"] = [1] * len(r["completion_ids"])
        out.append({c: r[c] for c in COLS})
    return out


@pytest.mark.parametrize("order", ["shuffled with repeats", "sorted unique"])
def test_take_rows_gives_the_rows_asked_for_in_that_order(store, order):
    ref = _by_address(store)
    addr = np.array(sorted(ref), dtype=np.uint64)
    if order != "sorted unique":
        rng = np.random.default_rng(0)
        addr = rng.choice(addr, size=len(addr) + 20, replace=True)
    got = store.take_rows(addr, columns=COLS).to_pylist()
    assert got == _reference_rows(ref, addr)


def test_token_cache_matches_take_rows_over_many_draws(store):
    ref = _by_address(store)
    latest = 3
    sel = Selector(store, ReplayConfig(window=100, max_staleness=2, seed=1), record_usage=False)
    cache = TokenCache(store, max_tokens=10**9)
    for step in range(6):
        s = sel.sample(17, latest, learner_step=step)
        idx = np.arange(len(s))[::-1]  # any order of the selection's rows
        got = cache.rows(s, idx).select(COLS).to_pylist()
        want = _reference_rows(ref, s.row_addresses[idx])
        assert got == want
        views = cache.token_rows(s, idx)  # what the loader collates: offsets into the cache
        for name in TOKEN_COLUMNS:
            values, start, length = views.lists[name]
            lists = [values[a : a + b].tolist() for a, b in zip(start, length, strict=True)]
            assert lists == [r[name] for r in want], name
        assert views.sampling["temperature"].tolist() == [r["temperature"] for r in want]


def _reference_collate(rows: list[dict], adv: np.ndarray, pack: bool) -> dict[str, np.ndarray]:
    """Per row and token, in plain Python: what the batch layout documents."""
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    lengths = [len(x) for x in seqs]
    width = max(sum(lengths) if pack else max(lengths), 1)
    n = 1 if pack else len(rows)
    ids, pos = np.zeros((n, width), np.int64), np.zeros((n, width), np.int64)
    mask, blp, adv_t = (np.zeros((n, width - 1), np.float32) for _ in range(3))
    at = 0
    for k, r in enumerate(rows):
        row, start = (0, at) if pack else (k, 0)
        p = len(r["prompt_ids"])
        for j, tok in enumerate(seqs[k]):
            ids[row, start + j] = tok
            pos[row, start + j] = j
            c = j - p  # index in the completion
            if c >= 0 and j > 0:  # scored at the column before it, if there is one
                mask[row, start + j - 1] = r["loss_mask"][c]
                blp[row, start + j - 1] = r["behavior_logprobs"][c]
                adv_t[row, start + j - 1] = adv[k]
        at += lengths[k]
    return {
        "input_ids": ids,
        "position_ids": pos,
        "loss_mask": mask,
        "behavior_logprobs": blp,
        "advantages": adv_t,
    }


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("cache_tokens", [0, 10**9])
def test_loader_batches_equal_the_reference_collate(store, pack, cache_tokens):
    ref = _by_address(store)
    by_id = {r["rollout_id"]: a for a, r in ref.items()}
    ds = ReplayDataset(
        store,
        ReplayConfig(window=120, seed=3),
        batch_size=24,
        pack=pack,
        learner_version=3,
        steps=4,
        record_usage=False,
        cache_tokens=cache_tokens,
    )
    for b in ds:
        rows = _reference_rows(ref, [by_id[i] for i in b["rollout_ids"]])
        want = _reference_collate(rows, b["seq_advantages"].numpy(), pack)
        for key, value in want.items():
            assert np.array_equal(b[key].numpy(), value), key
        assert b["num_loss_tokens"] == int(want["loss_mask"].sum())


def test_collate_of_an_empty_shard_and_of_one_row(store):
    sel = Selector(store, ReplayConfig(seed=0), record_usage=False).sample(1, 3)
    cache = TokenCache(store, max_tokens=10**9)
    none = np.zeros(0, np.int64)
    empty = collate(cache.rows(sel, none), sel, none, pack=False)
    assert empty["input_ids"].shape == (0, 1) and empty["num_tokens"] == 0
    one = collate(cache.rows(sel, np.arange(1)), sel, np.arange(1), pack=True)
    assert one["input_ids"].shape[0] == 1 and one["cu_seqlens"].tolist()[0] == 0
    assert torch.equal(one["attention_mask"], torch.ones_like(one["input_ids"]))


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 5), st.lists(st.integers(0, 1), max_size=5)),
        min_size=1,
        max_size=7,
    ),
    pack=st.booleans(),
    data=st.data(),
)
def test_collate_of_views_equals_the_reference_for_any_lengths(rows, pack, data):
    """Any lengths (empty prompts and completions too, as stores from before append refused
    them hold), multi-turn loss masks, rows taken in any order: the views the token cache
    hands over collate exactly as the reference lays the rows out, and as the table does."""
    n = len(rows)
    plain = [
        {
            "prompt_ids": list(range(1, p + 1)),
            "completion_ids": [100 + j for j in range(len(m))],
            "behavior_logprobs": [-(j + 1) / 8 for j in range(len(m))],
            "loss_mask": m,
            "temperature": 0.5 + k,
        }
        for k, (p, m) in enumerate(rows)
    ]
    table = pa.table(
        {
            "prompt_ids": pa.array([r["prompt_ids"] for r in plain], pa.list_(pa.int32())),
            "completion_ids": pa.array([r["completion_ids"] for r in plain], pa.list_(pa.int32())),
            "behavior_logprobs": pa.array(
                [r["behavior_logprobs"] for r in plain], pa.list_(pa.float32())
            ),
            "loss_mask": pa.array([r["loss_mask"] for r in plain], pa.list_(pa.int8())),
            "temperature": pa.array([r["temperature"] for r in plain], pa.float32()),
        }
    )
    order = np.asarray(data.draw(st.permutations(range(n))), np.int64)
    sel = plain_selection(n, np.linspace(-1, 1, n))
    views = collate(TokenRows.of_table(table).take(order), sel, order, pack=pack)
    whole = collate(table.take(pa.array(order)), sel, order, pack=pack)
    want = _reference_collate([plain[i] for i in order], sel.advantages[order], pack)
    for key, value in want.items():
        assert np.array_equal(views[key].numpy(), value), key
        assert np.array_equal(whole[key].numpy(), value), key
    assert views["num_loss_tokens"] == int(want["loss_mask"].sum())
    assert views["num_tokens"] == sum(len(r["prompt_ids"]) + len(r["loss_mask"]) for r in plain)
    assert views["temperature"].tolist() == [plain[i]["temperature"] for i in order]
    assert np.array_equal(views["attention_mask"].numpy(), whole["attention_mask"].numpy())
    if pack:
        assert views["attention_mask"].numpy().sum() == views["num_tokens"]
        assert views["cu_seqlens"].tolist()[-1] == views["num_tokens"]


@settings(max_examples=100, deadline=None)
@given(
    logp=st.lists(st.sampled_from([0.0, -1.0, 2.5, -np.inf]), min_size=1, max_size=60),
    k=st.integers(0, 70),
    seed=st.integers(0, 2**16),
)
def test_the_first_k_of_a_draw_order_are_the_full_orders_first_k(logp, k, seed):
    """The partial order the draw takes without a per-prompt cap: the same rows in the same
    order as the full stable order's prefix (ties, -inf priorities), and the generator
    left in the same state, so later draws of the batch do not change."""
    from rolloutstore.replay.draw import _gumbel_order

    logp = np.asarray(logp)
    full_rng, part_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    full = _gumbel_order(logp, full_rng)
    part = _gumbel_order(logp, part_rng, k)
    assert part.tolist() == full[:k].tolist()
    assert full_rng.random() == part_rng.random()
