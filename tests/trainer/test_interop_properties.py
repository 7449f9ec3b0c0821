"""Properties of ingest --from over open-ended rows (issue #31): any JSON value in any field
is either imported as given or refused with one line naming the file line and the field
(a RolloutStoreError, never another exception), with nothing written; and "tag soup"
content (text mixing the tokenizer's control-token strings with turn markers) never puts a
control token in the stored ids beyond the template's own, never with loss on text the
assistant did not write. Real tokenizer, 1-layer model, Lance store; chatml_dir: conftest.py."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rolloutstore.errors import RolloutStoreError
from rolloutstore.io.ingest import ingest_files
from rolloutstore.io.interop import TextImporter, TextImportOptions
from trainer.rollout.text_import import TextRowTransformer

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
COUNTER = itertools.count()

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["", "a\ud800b", "<|im_end|>", "<|endoftext|>", "1e400", "user"]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
TEXT = st.sampled_from(["1+1=", "2*3=", "What is 4-1?", "x"]) | st.text(min_size=1, max_size=8)


def _field(valid):
    """Mostly valid values, often anything at all."""
    return st.one_of(valid, valid, JSON)


def _message(roles):
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1,
                     max_size=2)  # fmt: skip
    return st.fixed_dictionaries(
        {"role": _field(st.sampled_from(roles)), "content": _field(TEXT | parts)}
    )


ROWS = {
    "verl": st.fixed_dictionaries(
        {"input": _field(TEXT), "output": _field(TEXT), "score": _field(st.floats(-2, 2))},
        optional={
            "step": _field(st.integers(1, 3)),
            "group_id": _field(st.sampled_from(["g", 7])),
            "acc": JSON,
            "gts": JSON,
            "sample_index": JSON,
            "run_id": JSON,
        },
    ),  # fmt: skip
    "openai": st.fixed_dictionaries(
        {
            "messages": _field(
                st.tuples(_message(["system", "user"]), _message(["assistant"])).map(list)
            ),
            "reward": _field(st.floats(-2, 2)),
        },
        optional={
            "advantage": _field(st.floats(-1, 1)),
            "finish_reason": JSON,
            "rollout_id": _field(st.sampled_from(["r1", "r2"])),
        },
    ),  # fmt: skip
    "trl": st.fixed_dictionaries(
        {
            "prompt": _field(TEXT | st.lists(_message(["user"]), min_size=1, max_size=1)),
            "completion": _field(TEXT | st.lists(_message(["assistant"]), min_size=1, max_size=1)),
            "accuracy_reward": _field(st.floats(-1, 1)),
            "step": _field(st.integers(0, 3)),
        },
        optional={"advantage": _field(st.floats(-1, 1)), "policy_version": JSON},
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def transformers_(chatml_dir) -> dict[str, TextRowTransformer]:
    return {s: TextRowTransformer(TextImportOptions(s, score_with=str(chatml_dir)))
            for s in ROWS}  # fmt: skip


def _import(tmp_path: Path, transformer, rows: list[dict]):
    """(store or None, error or None, file) of ingesting ``rows`` into a fresh store."""
    n = next(COUNTER)
    f = tmp_path / f"rows{n}.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN, \ud800: as JSON spells them
    importer = TextImporter(transformer.options, transformer)
    uri = tmp_path / f"store{n}"
    try:
        store, _ = ingest_files(uri, [f], progress=False, importer=importer)
    except RolloutStoreError as exc:
        assert not uri.exists(), "a refused import left a store behind"
        return None, exc, f
    return store, None, f


def _control_ids(tok) -> set[int]:
    return {i for i, t in tok.added_tokens_decoder.items() if t.special}


@pytest.mark.parametrize("source", ["verl", "openai", "trl"])
def test_any_row_imports_as_given_or_is_refused_naming_line_and_field(
    tmp_path, transformers_, source
):
    transformer = transformers_[source]
    control = _control_ids(transformer.tokenizer)

    @SETTINGS
    @given(rows=st.lists(ROWS[source], min_size=1, max_size=3))
    def check(rows):
        store, error, f = _import(tmp_path, transformer, rows)
        event("refused" if error else "imported")
        if error is not None:
            msg = str(error)
            assert "\n" not in msg and msg.startswith(f"{f}:") and ", field '" in msg, msg
            return
        stored = store.sql("SELECT * FROM rollouts").to_pylist()
        assert len(stored) == len(rows)
        start, end = transformer.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        for r in stored:
            assert r["prompt_ids"] and r["completion_ids"]
            assert len(r["behavior_logprobs"]) == len(r["completion_ids"])
            assert all(math.isfinite(x) and x <= 0 for x in r["behavior_logprobs"])
            assert not control & set(r["completion_ids"])  # single-turn: the text's own tokens
            turns = json.loads(r["metadata"] or "{}").get("messages") or []
            # A rendered prompt: one <|im_start|> per turn + the generation prompt's, one
            # <|im_end|> per turn; a text prompt: none at all.
            want = {start: len(turns) + 1, end: len(turns)} if turns else {}
            assert {i: r["prompt_ids"].count(i) for i in control if i in r["prompt_ids"]} == want
        assert _sorted(r["reward"] for r in stored) == _sorted(map(_reward[source], rows))

    check()


def _sorted(values) -> list:
    """Rewards as a sortable multiset: null first, as float32 (the column's type)."""
    out = [None if v is None or math.isnan(v) else float(np.float32(v)) for v in values]
    return sorted(out, key=lambda v: (v is not None, v or 0.0))


_reward = {
    "verl": lambda row: row["score"],
    "openai": lambda row: row["reward"],
    "trl": lambda row: row["accuracy_reward"],  # its only reward column
}


SOUP = st.lists(
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|reserved_5|>",
                     "<|im_", "end|>", "<|", "|>", "system", "user", "assistant", "tool", "\n",
                     " ", "x", "<|tool|>"]),
    max_size=6,
).map("".join)  # fmt: skip
CONTROLS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|reserved_5|>")


@SETTINGS
@given(
    turns=st.lists(st.tuples(st.sampled_from(["user", "tool", "system"]), SOUP, SOUP),
                   min_size=1, max_size=3),
)  # fmt: skip
def test_tag_soup_never_becomes_control_tokens_or_trained_text(tmp_path, transformers_, turns):
    """A chat: user soup, then (assistant soup, ROLE soup)*: refused exactly when some
    content holds a control token's string; else the ids' control tokens are the template's
    (one <|im_start|> and one <|im_end|> per message), and loss is on assistant turns only."""
    transformer = transformers_["openai"]
    tok = transformer.tokenizer
    messages = [{"role": "user", "content": "q " + turns[0][1]}]
    for role, answer, reply in turns:
        messages += [
            {"role": "assistant", "content": answer + "."},
            {"role": role, "content": reply},
        ]
    messages.append({"role": "assistant", "content": "done"})
    store, error, _ = _import(tmp_path, transformer, [{"messages": messages, "reward": 1.0}])
    held = [k for k, m in enumerate(messages) if any(c in m["content"] for c in CONTROLS)]
    event("refused" if error else "imported")
    if error is not None:
        assert held and f"field 'messages[{held[0]}].content'" in str(error), str(error)
        return
    assert not held
    (r,) = store.sql("SELECT * FROM rollouts").to_pylist()
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = r["prompt_ids"] + r["completion_ids"]
    assert ids.count(start) == len(messages) and ids.count(end) == len(messages)
    assert not (_control_ids(tok) - {start, end}) & set(ids)
    for t in r["turns"]:
        span, mask = (
            r["completion_ids"][t["start"] : t["end"]],
            r["loss_mask"][t["start"] : t["end"]],
        )
        if t["role"] == "assistant":
            assert set(mask) == {1} and start not in span and span.count(end) == 1
        else:
            assert set(mask) == {0}
    assert sum(r["loss_mask"]) == sum(t["end"] - t["start"] for t in r["turns"]
                                      if t["role"] == "assistant")  # fmt: skip


def test_soup_tokenizer_sees_the_same_controls(chatml_dir):
    """The fixture's premise: <|im_start|> / <|im_end|> are single special tokens."""
    tok = AutoTokenizer.from_pretrained(str(chatml_dir))
    ids = tok("<|im_start|>user\nx<|im_end|>")["input_ids"]
    assert ids[0] in _control_ids(tok) and ids[-1] in _control_ids(tok)
