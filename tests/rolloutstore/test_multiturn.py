"""Schema v2, multi-turn trajectories: what the store accepts, refuses, derives and reads back
(real Lance and DuckDB): loss masks, turns, log-probs on environment tokens, the derived
columns, the `turns` view, `where` over the new columns, and the loader's masks."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore, Selector
from rolloutstore.errors import ValidationError


def trajectory(**over) -> dict:
    """A calculator trajectory: assistant (3 tokens), tool (2), assistant (2)."""
    row = {
        "prompt_ids": [1, 2, 3],
        "completion_ids": [10, 11, 12, 20, 21, 13, 14],
        "behavior_logprobs": [-0.5, -0.25, -1.0, None, 0.0, -0.125, -2.0],
        "loss_mask": [1, 1, 1, 0, 0, 1, 1],
        "turns": [
            {"role": "assistant", "start": 0, "end": 3},
            {"role": "tool", "start": 3, "end": 5, "tool_name": "calculator"},
            {"role": "assistant", "start": 5, "end": 7},
        ],
        "policy_version": 0,
        "finish_reason": "stop",
        "reward": 1.0,
    }
    row.update(over)
    return row


def single(**over) -> dict:
    row = {"prompt_ids": [1, 2], "completion_ids": [5, 6, 7],
           "behavior_logprobs": [-0.5, -0.5, -0.5], "policy_version": 0}  # fmt: skip
    row.update(over)
    return row


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    return RolloutStore.open(tmp_path / "store", embedding_dim=4)


def test_trajectory_round_trips_with_derived_columns(store):
    store.append([trajectory(rollout_id="t"), single(rollout_id="s")])
    got = {
        r["rollout_id"]: r
        for r in store.sql(
            "SELECT rollout_id, loss_mask, turns, num_turns, num_model_tokens, num_tool_calls, "
            "tools, behavior_logprobs, num_completion_tokens FROM rollouts"
        ).to_pylist()
    }
    t, s = got["t"], got["s"]
    assert t["loss_mask"] == [1, 1, 1, 0, 0, 1, 1]
    assert [x["role"] for x in t["turns"]] == ["assistant", "tool", "assistant"]
    assert t["turns"][1] == {"role": "tool", "start": 3, "end": 5, "tool_name": "calculator"}
    assert (t["num_turns"], t["num_model_tokens"], t["num_tool_calls"]) == (3, 5, 1)
    assert t["tools"] == ["calculator"]
    assert t["behavior_logprobs"] == [-0.5, -0.25, -1.0, 0.0, 0.0, -0.125, -2.0]  # None -> 0.0
    # A row without a mask or turns: all ones, one assistant turn.
    assert s["loss_mask"] == [1, 1, 1] and s["turns"] is None
    assert (s["num_turns"], s["num_model_tokens"], s["num_tool_calls"], s["tools"]) == (
        1, 3, 0, []
    )  # fmt: skip
    # On disk an all-ones mask is null (cheap); every read shows the ones.
    raw = store.dataset().to_table(columns=["rollout_id", "loss_mask"]).to_pylist()
    assert {r["rollout_id"]: r["loss_mask"] for r in raw} == {"t": t["loss_mask"], "s": None}
    taken = store.take([0, 1], columns=["rollout_id", "loss_mask"]).to_pylist()
    assert {r["rollout_id"]: r["loss_mask"] for r in taken} == {"t": t["loss_mask"], "s": [1] * 3}
    assert store.take([0]).column_names == store.schema.names


def test_turns_view_one_row_per_turn(store):
    store.append([trajectory(rollout_id="t"), single(rollout_id="s")])
    rows = store.sql("SELECT * FROM turns ORDER BY rollout_id DESC, turn").to_pylist()
    assert [(r["rollout_id"], r["turn"], r["role"], r["start"], r["end"]) for r in rows] == [
        ("t", 0, "assistant", 0, 3), ("t", 1, "tool", 3, 5), ("t", 2, "assistant", 5, 7),
        ("s", 0, "assistant", 0, 3),
    ]  # fmt: skip
    assert [r["num_tokens"] for r in rows] == [3, 2, 2, 3]
    assert [r["num_model_tokens"] for r in rows] == [3, 0, 2, 3]
    assert rows[1]["tool_name"] == "calculator" and rows[0]["tool_name"] is None
    calls = store.sql("SELECT tool_name, count(*) AS n FROM turns WHERE role = 'tool' GROUP BY 1")
    assert calls.to_pylist() == [{"tool_name": "calculator", "n": 1}]


def _turns(*spec) -> list[dict]:
    return [{"role": r, "start": a, "end": b, **({"tool_name": t} if t else {})}
            for r, a, b, t in spec]  # fmt: skip


BAD = [
    ({"loss_mask": [1, 1, 1]}, "loss_mask", "one value per completion token"),
    ({"loss_mask": [1, 1, 1, 0, 2, 1, 1]}, "loss_mask", "expected 0 or 1, found 2"),
    ({"loss_mask": [0] * 7, "turns": None, "behavior_logprobs": [0.0] * 7}, "loss_mask",
     "at least one 1"),
    ({"loss_mask": [1, 1, 1, 0, None, 1, 1]}, "loss_mask", "null element"),
    ({"turns": _turns(("assistant", 0, 3, None), ("tool", 4, 5, "c"), ("assistant", 5, 7, None))},
     "turns", "turn 1: starts at 4 but the turn before ends at 3"),
    ({"turns": _turns(("assistant", 0, 3, None), ("tool", 2, 5, "c"), ("assistant", 5, 7, None))},
     "turns", "turn 1: starts at 2"),
    ({"turns": _turns(("assistant", 0, 3, None), ("tool", 3, 5, "c"))}, "turns",
     "turn 1: the last turn ends at 5, expected the completion's end 7"),
    ({"turns": _turns(("assistant", 1, 3, None), ("tool", 3, 5, "c"), ("assistant", 5, 7, None))},
     "turns", "turn 0: starts at 1, expected 0"),
    ({"turns": _turns(("assistant", 0, 3, None), ("tool", 3, 5, "c"), ("assistant", 5, 9, None))},
     "turns", "turn 2: [5, 9) is outside"),
    ({"turns": _turns(("assistant", 0, 3, None), ("robot", 3, 5, None), ("assistant", 5, 7, None))},
     "turns", "unknown role 'robot'"),
    ({"turns": _turns(("assistant", 0, 3, "calc"), ("tool", 3, 5, None), ("assistant", 5, 7, None))},
     "turns", "tool_name 'calc' on a 'assistant' turn"),
    ({"turns": []}, "turns", "at least one turn"),
    ({"turns": [{"role": None, "start": 0, "end": 7}]}, "turns", "turn 0 is a turn without role"),
    ({"turns": [{"role": "assistant", "start": 0, "end": 7, "color": "red"}]}, "turns",
     "expected list<item: struct<role"),
    ({"loss_mask": [1, 1, 1, 1, 0, 1, 1], "behavior_logprobs": [-0.5] * 7}, "loss_mask",
     "loss_mask is 1 at position 3, inside a 'tool' turn"),
    ({"behavior_logprobs": [-0.5, -0.25, -1.0, -0.3, 0.0, -0.125, -2.0]}, "behavior_logprobs",
     "no log-prob on environment tokens"),
    ({"behavior_logprobs": [-0.5, None, -1.0, 0.0, 0.0, -0.125, -2.0]}, "behavior_logprobs",
     "null log-prob on a loss_mask-1 token"),
    ({"behavior_logprobs": [-0.5, 0.5, -1.0, 0.0, 0.0, -0.125, -2.0]}, "behavior_logprobs",
     "finite and <= 0; found 0.5 at position 1"),
    ({"num_turns": 2}, "num_turns", "expected len(turns) (1 when null) = 3, found 2"),
    ({"num_model_tokens": 7}, "num_model_tokens", "expected sum(loss_mask) = 5, found 7"),
    ({"num_tool_calls": 0}, "num_tool_calls", "= 1, found 0"),
    ({"tools": ["search"]}, "tools", "found ['search']"),
    ({"loss_mask": [True] * 7}, "loss_mask", "expected list<item: int8>"),
]  # fmt: skip


@pytest.mark.parametrize("over,field,words", BAD)
def test_bad_trajectory_refused_naming_row_and_field(store, over, field, words):
    store.append([single()])
    before = (store.count(), store.version)
    rows = [single(), trajectory(**over)]
    with pytest.raises(ValidationError) as info:
        store.append(iter([rows[:1], rows[1:]]))  # rows counted across chunks
    exc = info.value
    assert (exc.row, exc.field) == (1, field), str(exc)
    assert words in str(exc), str(exc)
    assert (store.count(), store.version) == before  # nothing of the batch written


def test_derived_values_given_equal_are_accepted(store):
    row = trajectory(num_turns=3, num_model_tokens=5, num_tool_calls=1, tools=["calculator"])
    assert store.append([row]).rows == 1
    empty_turn = trajectory(
        turns=_turns(
            ("assistant", 0, 3, None),
            ("tool", 3, 5, "c"),
            ("tool", 5, 5, None),
            ("assistant", 5, 7, None),
        )
    )  # fmt: skip  (an empty tool turn: a tool that printed nothing)
    assert store.append([empty_turn]).rows == 1
    assert store.sql("SELECT max(num_tool_calls) AS n FROM rollouts")["n"][0].as_py() == 2


def test_a_user_turn_and_a_trailing_environment_turn_are_kept(store):
    row = trajectory(
        completion_ids=[10, 11, 12, 20, 21, 13, 14, 30],
        behavior_logprobs=[-0.5, -0.25, -1.0, 0.0, 0.0, -0.125, -2.0, 0.0],
        loss_mask=[1, 1, 1, 0, 0, 1, 1, 0],
        turns=_turns(("assistant", 0, 3, None), ("user", 3, 5, None), ("assistant", 5, 7, None),
                     ("system", 7, 8, None)),
        finish_reason="max_turns",
    )  # fmt: skip
    store.append([row])
    got = store.sql("SELECT num_turns, num_tool_calls, tools FROM rollouts").to_pylist()
    assert got == [{"num_turns": 4, "num_tool_calls": 0, "tools": []}]


def _sample_ids(store, where, params=()):
    cfg = ReplayConfig(seed=0, where=where, where_params=tuple(params))
    return set(Selector(store, cfg, record_usage=False).candidates(0)["rollout_id"].to_pylist())


def test_where_filters_on_turns_tools_and_finish_reason(store):
    rows = [
        trajectory(rollout_id="calc", finish_reason="stop"),
        trajectory(rollout_id="cut", finish_reason="max_turns",
                   turns=_turns(("assistant", 0, 3, None), ("tool", 3, 5, "search"),
                                ("assistant", 5, 7, None))),
        single(rollout_id="plain", finish_reason="length"),
    ]  # fmt: skip
    store.append(rows)
    assert _sample_ids(store, "list_contains(tools, ?)", ["calculator"]) == {"calc"}
    assert _sample_ids(store, "num_tool_calls >= ?", [1]) == {"calc", "cut"}
    assert _sample_ids(store, "num_turns = 1") == {"plain"}
    assert _sample_ids(store, "num_model_tokens < num_completion_tokens") == {"calc", "cut"}
    assert _sample_ids(store, "finish_reason = ?", ["max_turns"]) == {"cut"}
    assert _sample_ids(store, "len(tools) = 0") == {"plain"}
    # The same `where` in SQL exports and in the `sample` command's validator.
    out = store.sql("SELECT rollout_id FROM rollouts WHERE list_contains(tools, ?)", ["search"])
    assert out["rollout_id"].to_pylist() == ["cut"]
    with pytest.raises(ValueError, match="unknown column 'loss_mask'"):
        ReplayConfig(where="list_contains(loss_mask, 0)")  # token lists are not selectable


def _loader_batch(store, **kw):
    ds = ReplayDataset(store, ReplayConfig(seed=0), batch_size=3, learner_version=0, steps=1,
                       record_usage=False, prefetch=0, **kw)  # fmt: skip
    (batch,) = list(ds)
    return batch


@pytest.mark.parametrize("pack", [False, True])
def test_loader_multiplies_the_loss_mask_and_counts_model_tokens(store, pack):
    store.append([trajectory(rollout_id="t"), single(rollout_id="s"),
                  trajectory(rollout_id="u", prompt_ids=[4])])  # fmt: skip
    batch = _loader_batch(store, pack=pack)
    assert batch["num_loss_tokens"] == 5 + 3 + 5 == int(batch["loss_mask"].sum())
    assert batch["num_tokens"] == (3 + 7) + (2 + 3) + (1 + 7)  # budgets count every token
    order = batch["rollout_ids"]
    width = batch["input_ids"].shape[1]
    for i, rid in enumerate(order):
        if rid == "s":
            continue
        p = 3 if rid == "t" else 1
        start = (sum(_len(o) for o in order[:i]) if pack else 0) + p - 1
        row = 0 if pack else i
        got = batch["loss_mask"][row, start : start + 7].tolist()
        assert got == [1, 1, 1, 0, 0, 1, 1], (rid, got)
        assert batch["behavior_logprobs"][row, start + 3 : start + 5].tolist() == [0.0, 0.0]
    assert width >= 10


def _len(rid: str) -> int:
    return {"t": 10, "s": 5, "u": 8}[rid]


def test_micro_batches_count_every_token_but_normalise_by_model_tokens(store):
    store.append([trajectory(rollout_id=f"t{i}") for i in range(3)])
    mbs = _loader_batch(store, micro_batch_tokens=10)
    assert len(mbs) == 3  # 10 tokens per row: one row per micro-batch, masked tokens included
    assert all(mb["step_loss_tokens"] == 15 for mb in mbs)
    assert sum(mb["num_loss_tokens"] for mb in mbs) == 15


def test_a_batch_of_dicts_is_not_changed_by_append(store):
    rows = [trajectory()]
    kept = copy.deepcopy(rows)
    store.append(rows)
    assert rows == kept


def test_numpy_masks_and_tables_are_accepted(store):
    import pyarrow as pa

    rows = [trajectory(rollout_id="np", loss_mask=np.array([1, 1, 1, 0, 0, 1, 1]).tolist())]
    table = pa.Table.from_pylist([trajectory(rollout_id="tbl")])
    store.append(rows)
    store.append(table)
    got = store.sql("SELECT rollout_id, num_model_tokens FROM rollouts ORDER BY 1").to_pylist()
    assert got == [{"rollout_id": "np", "num_model_tokens": 5},
                   {"rollout_id": "tbl", "num_model_tokens": 5}]  # fmt: skip
