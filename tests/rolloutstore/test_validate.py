"""Bad input is refused naming the row and field; nothing of the batch is written."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from helpers import make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore, SchemaError, ValidationError
from rolloutstore.schema.validate import prepare


def _corrupt(row: dict, kind: str, value) -> str:
    """Break ``row`` in one way; return the field the error must name."""
    if kind == "negative_id":
        field = value
        row[field] = list(row[field])
        row[field][len(row[field]) // 2] = -1 - len(row[field])
        return field
    if kind == "positive_logprob":
        row["behavior_logprobs"] = list(row["behavior_logprobs"])
        row["behavior_logprobs"][-1] = value
        return "behavior_logprobs"
    if kind == "length_mismatch":
        row["behavior_logprobs"] = list(row["behavior_logprobs"]) + [-0.5] * value
        return "behavior_logprobs"
    if kind == "missing_required":
        row.pop(value)
        return value
    if kind == "null_required":
        row[value] = None
        return value
    if kind == "wrong_type":
        field, bad = value
        row[field] = bad
        return field
    if kind == "bad_reward":
        row["reward"] = value
        return "reward"
    if kind == "unknown_field":
        row[value] = 1
        return value
    if kind == "bad_json":
        row["reward_info"] = value
        return "reward_info"
    raise AssertionError(kind)


corruptions = st.one_of(
    st.tuples(st.just("negative_id"), st.sampled_from(["prompt_ids", "completion_ids"])),
    st.tuples(
        st.just("positive_logprob"),
        st.one_of(st.floats(min_value=1e-3, max_value=1e6), st.just(math.nan), st.just(-math.inf)),
    ),
    st.tuples(st.just("length_mismatch"), st.integers(1, 3)),
    st.tuples(
        st.just("null_required"),
        st.sampled_from(["prompt_ids", "completion_ids", "behavior_logprobs", "policy_version"]),
    ),
    st.tuples(
        st.just("wrong_type"),
        st.sampled_from(
            [
                ("policy_version", "seven"),
                ("completion_ids", "abc"),
                ("prompt_ids", [1.5, "x"]),
                ("reward", "high"),
                ("sample_index", [1]),
            ]
        ),
    ),
    st.tuples(st.just("bad_reward"), st.sampled_from([math.inf, -math.inf])),
    st.tuples(st.just("unknown_field"), st.sampled_from(["rewrd", "logprobs"])),
    st.tuples(
        st.just("bad_json"), st.sampled_from(["{not json", "[1, 2", "[" * 10**5 + "]" * 10**5])
    ),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(n=st.integers(1, 12), data=st.data(), corruption=corruptions)
def test_bad_row_is_named_and_nothing_is_written(tmp_path_factory, n, data, corruption):
    store = RolloutStore.open(tmp_path_factory.mktemp("s"))
    good = make_rows(5, seed=99)
    store.append(good)
    before = store.dataset().to_table()
    version = store.version

    rows = make_rows(n, seed=n)
    bad_row = data.draw(st.integers(0, n - 1))
    kind, value = corruption
    field = _corrupt(rows[bad_row], kind, value)

    with pytest.raises(ValidationError) as err:
        store.append(rows)
    assert err.value.row == bad_row, str(err.value)
    assert err.value.field == field, str(err.value)
    assert f"row {bad_row}" in str(err.value) and field in str(err.value)
    assert store.version == version
    assert store.dataset().to_table().equals(before)


def test_errors_are_value_errors_with_the_fix():
    assert issubclass(ValidationError, ValueError) and issubclass(ValidationError, SchemaError)


def test_row_index_counts_across_batches(store):
    first = pa.Table.from_pylist(make_rows(4, seed=1))
    rows = make_rows(3, seed=2)
    rows[2]["completion_ids"] = [-5] + rows[2]["completion_ids"][1:]
    second = pa.Table.from_pylist(rows)
    with pytest.raises(ValidationError) as err:
        store.append(iter([first, second]))
    assert err.value.row == 6 and err.value.field == "completion_ids"
    assert store.count() == 0


def test_token_count_given_must_match(store):
    rows = make_rows(2)
    rows[1]["num_completion_tokens"] = len(rows[1]["completion_ids"]) + 1
    with pytest.raises(ValidationError, match="num_completion_tokens"):
        store.append(rows)


def test_duplicate_rollout_id_in_batch(store):
    rows = make_rows(3)
    rows[0]["rollout_id"] = rows[2]["rollout_id"] = "same"
    with pytest.raises(ValidationError) as err:
        store.append(rows)
    assert err.value.field == "rollout_id"


def test_embedding_dimension_is_enforced(store):
    rows = make_rows(3)
    rows[0]["embedding"] = [0.0] * store.embedding_dim
    rows[1]["embedding"] = [0.0] * (store.embedding_dim + 1)
    with pytest.raises(ValidationError) as err:
        store.append(rows)
    assert (err.value.row, err.value.field) == (1, "embedding")


def test_prepare_outputs_exact_schema(store):
    t = prepare(make_rows(3), store.schema)
    assert t.schema.equals(store.schema, check_metadata=False)


def test_json_nested_too_deeply_to_read_is_refused_naming_row_and_field(store):
    rows = make_rows(3)
    rows[1]["metadata"] = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValidationError, match=r"row 1, field 'metadata': .* too deep"):
        store.append(rows)
    assert store.count() == 0
