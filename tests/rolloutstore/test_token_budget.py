"""The loader's token budget (max_tokens_per_batch): rows longer than it are never drawn but
counted and warned about; a batch it shrinks is counted and warned about once (budget.py)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.errors import RowOverBudgetError, RowOverBudgetWarning, ShrunkBatchWarning
from rolloutstore.replay.budget import budget_metrics
from rolloutstore.replay.selector import Selector

LONG_TOKENS = 400  # completion tokens of the long rows; the others hold at most 58 in all


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.open(tmp_path_factory.mktemp("budget") / "store")
    rows = make_rows(120, seed=3)
    for r in rows[:3]:  # three rows no 200-token batch can hold
        r["completion_ids"] = [7] * LONG_TOKENS
        r["behavior_logprobs"] = [-0.5] * LONG_TOKENS
    s.append(rows)
    return s


def _long_ids(store) -> set[str]:
    t = store.sql("SELECT rollout_id FROM rollouts WHERE num_completion_tokens = ?", [LONG_TOKENS])
    return set(t["rollout_id"].to_pylist())


def _loader(store, **kw) -> ReplayDataset:
    return ReplayDataset(
        store, ReplayConfig(seed=5, window=1000), record_usage=False, prefetch=0, **kw
    )


def test_rows_over_the_budget_are_never_drawn_but_counted_and_warned_once(store):
    long = _long_ids(store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(_loader(store, batch_size=4, max_tokens_per_batch=200, steps=25))
    over = [w for w in caught if issubclass(w.category, RowOverBudgetWarning)]
    assert len(over) == 1  # once per run, not per step
    msg = str(over[0].message)
    first = re.search(r"first: rollout_id (\S+), (\d+) tokens", msg)
    assert "3 of 120 eligible rows" in msg and "max_tokens=200" in msg
    assert first[1] in long and int(first[2]) > LONG_TOKENS and "max_tokens_per_batch" in msg
    for b in batches:
        assert not long & set(b["rollout_ids"])
        assert b["num_tokens"] <= 200
        assert budget_metrics(b)["rows_over_budget"] == 3


def test_the_old_rule_would_have_trained_them(store):
    # Without the budget the long rows are drawn like any other: the budget is what kept them out.
    long = _long_ids(store)
    drawn = {i for b in _loader(store, batch_size=16, steps=25) for i in b["rollout_ids"]}
    assert long <= drawn


def test_every_row_over_the_budget_is_an_error_naming_the_shortest(tmp_path):
    s = RolloutStore.open(tmp_path / "s")
    s.append(make_rows(8, seed=1))
    lengths = s.sql("SELECT num_prompt_tokens + num_completion_tokens AS n FROM rollouts")["n"]
    shortest = min(lengths.to_pylist())
    with pytest.raises(RowOverBudgetError, match=f"shortest: {shortest} tokens"):
        next(iter(_loader(s, batch_size=4, max_tokens_per_batch=shortest - 1, steps=1)))


def test_a_shrunk_batch_is_counted_each_step_and_warned_once(store):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(_loader(store, batch_size=16, max_tokens_per_batch=150, steps=6))
    shrunk = [w for w in caught if issubclass(w.category, ShrunkBatchWarning)]
    assert len(shrunk) == 1 and "held" in str(shrunk[0].message)
    for b in batches:
        m = budget_metrics(b)
        assert m["batch_rows"] == len(b["rollout_ids"]) < 16
        assert m["batch_rows"] + m["batch_shrunk"] == 16


def test_no_budget_no_budget_keys(store):
    (b,) = _loader(store, batch_size=8, steps=1)
    assert budget_metrics(b) == {"batch_rows": 8}


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch_size=st.integers(1, 40), budget=st.integers(60, 3000), step=st.integers(0, 50))
def test_a_budgeted_draw_fits_and_accounts_for_every_row(store, batch_size, budget, step):
    sel = Selector(store, ReplayConfig(seed=5, window=1000), record_usage=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = sel.sample(batch_size, 0, max_tokens=budget, learner_step=step)
    lengths = store.sql(
        "SELECT rollout_id, num_prompt_tokens + num_completion_tokens AS n FROM rollouts"
    ).to_pylist()
    n = {r["rollout_id"]: r["n"] for r in lengths}
    drawn = np.array([n[i] for i in s.rollout_ids])
    assert 1 <= len(s) <= batch_size and drawn.sum() <= budget
    assert len(s) + s.budget_cut == batch_size  # drawn or cut: none vanish
    assert s.over_budget == sum(v > budget for v in n.values())
    sel.close()
