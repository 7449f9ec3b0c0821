"""export --as sft|dpo of rows whose metadata holds odd chat messages, or whose text is null
(issue 31, items 13 and 19): the three text shapes read a row's messages by one rule (the
``--as messages`` rule: a list of objects is the turns, a role or content that is not text
is its JSON text, anything else is no turns) and refuse a row without text, naming it.

The property test stores a group of two rows (rewards 1 and 0) with hypothesis-drawn
``messages`` / ``completion_messages`` shapes and nullable texts and exports it three ways.
Chat rows (the prompt's ``messages`` a list): ``dpo`` writes both rows, so it succeeds exactly
when ``messages`` does, with the same turns; ``sft`` writes the better row, so it succeeds
exactly when that row's conversation does. Text rows: both write the texts, or refuse a null
(rows with no text at all: their token ids, without text columns).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from rolloutstore.cli import main
from rolloutstore.errors import ExportError, ValidationError
from rolloutstore.io.shapes import chat_messages

DEEP = "[" * 900 + "1" + "]" * 900  # deeper than Python's json reads at some stack depths
TEXT = st.text("ab <>/\n", max_size=4)
LEAF = st.none() | st.booleans() | st.integers(-9, 9) | TEXT
JSON = st.recursive(
    LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
    max_leaves=6,
)  # fmt: skip
ROLE = st.sampled_from(["user", "system", "assistant", "tool"]) | JSON
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLE, "content": TEXT | JSON})
MESSAGES = JSON | st.lists(MESSAGE | LEAF, max_size=3) | st.lists(MESSAGE, min_size=1, max_size=3)


def _metadata(fields: dict) -> str:
    """JSON text of ``fields``; the marker "DEEP" becomes a 900-deep list, written as text
    (json.dumps itself would hit the recursion limit)."""
    return json.dumps(fields).replace('"DEEP"', DEEP)


def _row(rid: str, reward: float, prompt_text, completion_text, metadata: str) -> dict:
    return {"rollout_id": rid, "group_id": "g", "prompt_id": "p", "prompt_ids": [1],
            "completion_ids": [2], "behavior_logprobs": [-0.5], "policy_version": 0,
            "prompt_text": prompt_text, "completion_text": completion_text, "reward": reward,
            "metadata": metadata}  # fmt: skip


def _export(store: RolloutStore, out: Path, shape: str, **kw) -> list[dict] | str:
    """The exported rows, or the refusal's message (no output file left behind)."""
    try:
        store.export(out, as_=shape, progress=False, **kw)
    except ExportError as exc:
        assert not out.exists() and "\n" not in str(exc)
        return str(exc)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    return rows


def _as_chat(rows: list[dict], shape: str) -> list[list[dict]]:
    """sft / dpo rows as whole conversations (text rows: one user and one assistant turn)."""

    def turns(v, role):
        return v if isinstance(v, list) else [{"role": role, "content": v}]

    if shape == "sft":
        return [turns(r["prompt"], "user") + turns(r["completion"], "assistant") for r in rows]
    (r,) = rows
    prompt = turns(r["prompt"], "user")
    return [prompt + turns(r["chosen"], "assistant"), prompt + turns(r["rejected"], "assistant")]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_messages=MESSAGES | st.just("DEEP") | st.none(),
    done=st.lists(MESSAGES | st.just("DEEP") | st.none(), min_size=2, max_size=2),
    prompt_text=st.none() | TEXT,
    completions=st.lists(st.none() | TEXT, min_size=2, max_size=2),
)
def test_sft_and_dpo_read_any_message_shape_as_messages_does(
    prompt_messages, done, prompt_text, completions
):
    rows = []
    for k, (rid, reward) in enumerate([("a", 1.0), ("b", 0.0)]):
        meta = {}
        if prompt_messages is not None:
            meta["messages"] = prompt_messages
        if done[k] is not None:
            meta["completion_messages"] = done[k]
        rows.append(_row(rid, reward, prompt_text, completions[k], _metadata(meta)))
    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore.open(Path(tmp) / "s")
        try:
            store.append(rows)
        except ValidationError as exc:  # JSON too deep for the append's reader
            assert "too deep" in str(exc)
            return
        out = Path(tmp) / "o.jsonl"
        sft, dpo = _export(store, out, "sft"), _export(store, out, "dpo")
        if not isinstance(prompt_messages, list) and prompt_messages != "DEEP":
            # Text rows (no prompt turns): sft / dpo write prompt_text and completion_text.
            texts = [prompt_text, *completions]
            if texts == [None] * 3:  # token ids only: written without the text columns
                assert "prompt" not in sft[0] and "chosen" not in dpo[0], (sft, dpo)
                return
            if _refused(dpo, None in texts):
                assert [(r["prompt"], r["chosen"], r["rejected"]) for r in dpo] == [tuple(texts)]
            if _refused(sft, None in texts[:2]):
                assert [(r["prompt"], r["completion"]) for r in sft] == [tuple(texts[:2])]
            return
        conversations = _export(store, out, "messages")
        best = _export(store, out, "messages", where="rollout_id = 'a'")
    # Chat rows: the turns of --as messages, refused where it refuses.
    if _refused(dpo, isinstance(conversations, str)):
        assert _as_chat(dpo, "dpo") == [r["messages"] for r in conversations]
    if _refused(sft, isinstance(best, str)):
        assert _as_chat(sft, "sft") == [sft[0]["messages"]] == [best[0]["messages"]]


def _refused(got: list[dict] | str, refused: bool) -> bool:
    """Check that ``got`` is a refusal naming a rollout exactly when ``refused``; True when
    ``got`` is rows."""
    if refused:
        assert isinstance(got, str) and ("rollout a" in got or "rollout b" in got), got
    else:
        assert not isinstance(got, str), got
    return not refused


def test_the_shapes_of_the_issue(tmp_path, capsys):
    """``[1, 2]``, role 5, a dict / nested list / 900-deep list as content, ``[7]`` and
    ``[null]`` as completion_messages: sft and dpo write what --as messages writes."""
    cases = {
        "ints": {"messages": [1, 2]},
        "role": {"messages": [{"role": 5, "content": "x"}]},
        "dict": {"messages": [{"role": "user", "content": {"a": 1}}]},
        "nested": {"messages": [{"role": "user", "content": [[1, [2]]]}]},
        "deep": {"messages": [{"role": "user", "content": "DEEP"}]},
        "done7": {"messages": [{"role": "user", "content": "q"}], "completion_messages": [7]},
        "donenull": {"messages": [{"role": "user", "content": "q"}], "completion_messages": [None]},
    }
    for name, meta in cases.items():
        store = RolloutStore.open(tmp_path / name)
        store.append([_row(f"{name}-{r}", r, "p", f"c{r}", _metadata(meta)) for r in (1, 0)])
        out = tmp_path / f"{name}.jsonl"
        assert main(["export", store.uri, str(out), "--as", "messages", "-q"]) == 0
        want = {r["rollout_id"]: r["messages"] for r in map(json.loads, out.open())}
        for shape in ("sft", "dpo"):
            out = tmp_path / f"{name}-{shape}.jsonl"
            assert main(["export", store.uri, str(out), "--as", shape, "-q"]) == 0, name
            got = _as_chat([json.loads(line) for line in out.open()], shape)
            assert got == [want[f"{name}-1"]] if shape == "sft" else [*want.values()], name
    assert capsys.readouterr().err == ""
    assert want == {  # the last case: completion_messages [null] is no turns
        "donenull-1": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c1"}],
        "donenull-0": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c0"}],
    }


def test_messages_too_deep_to_read_are_refused_naming_rollout_and_field():
    with pytest.raises(ExportError, match=r"rollout r7: metadata 'messages' is JSON nested"):
        chat_messages("[" * 100_000 + "]" * 100_000, "r7", "messages")
    assert chat_messages('[{"role": 5, "content": null}]', "r", "messages") == [
        {"role": "5", "content": ""}
    ]
    assert chat_messages("[]", "r", "messages") is None


# -- null text (item 19) ---------------------------------------------------------------------
@pytest.mark.parametrize("field", ["prompt_text", "completion_text"])
@pytest.mark.parametrize("shape", ["sft", "dpo"])
def test_sft_and_dpo_refuse_null_text_naming_the_rollout(tmp_path, capsys, shape, field):
    store = RolloutStore.open(tmp_path / "s")
    rows = [_row("a", 1.0, "p", "good", "{}"), _row("b", 0.5, "p", "bad", "{}")]
    rows[0][field] = None
    store.append(rows)
    out = tmp_path / "new" / "o.jsonl"
    assert main(["export", store.uri, str(out), "--as", shape, "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: rollout a: {field} is null; --as {shape}") and "\n" not in err
    assert f"--where '{field} IS NOT NULL'" in err
    assert not (tmp_path / "new").exists()  # nothing written, not even the folder
    # The rows that have their text export; so do columns that hold no text.
    where = f"{field} IS NOT NULL"
    # dpo: one row left, no pair: an empty export is refused (exit 2), not written
    expect = 0 if shape == "sft" else 2
    assert main(["export", store.uri, str(out), "--as", shape, "--where", where, "-q"]) == expect
    cols = "prompt_ids,completion_ids" if shape == "sft" else "prompt_ids,chosen_ids"
    assert main(["export", store.uri, str(out), "--as", shape, "--columns", cols, "-q"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_dpo_names_the_rejected_rollout_and_chat_rows_need_no_prompt_text(tmp_path):
    store = RolloutStore.open(tmp_path / "s")
    chat = json.dumps({"messages": [{"role": "user", "content": "q"}]})
    store.append([_row("a", 1.0, None, "good", chat), _row("b", 0.0, None, None, chat)])
    with pytest.raises(ExportError, match="rollout b: completion_text is null; --as dpo"):
        store.export(tmp_path / "d.jsonl", as_="dpo", progress=False)
    assert store.export(tmp_path / "s.jsonl", as_="sft", progress=False).rows == 1
    (row,) = [json.loads(line) for line in (tmp_path / "s.jsonl").open()]
    assert row["messages"] == [{"role": "user", "content": "q"},
                               {"role": "assistant", "content": "good"}]  # fmt: skip


def test_rows_without_any_text_export_their_token_ids_only(tmp_path):
    store = RolloutStore.open(tmp_path / "s")
    store.append([_row("a", 1.0, None, None, "{}"), _row("b", 0.0, None, None, "{}")])
    sft, dpo = tmp_path / "sft.jsonl", tmp_path / "dpo.jsonl"
    assert store.export(sft, as_="sft", progress=False).rows == 1
    assert store.export(dpo, as_="dpo", progress=False).rows == 1
    (row,) = [json.loads(line) for line in sft.open()]
    assert row == {"prompt_ids": [1], "completion_ids": [2], "reward": 1.0, "prompt_id": "p",
                   "rollout_id": "a"}  # fmt: skip
    (row,) = [json.loads(line) for line in dpo.open()]
    assert "prompt" not in row and (row["chosen_ids"], row["rejected_ids"]) == ([2], [2])
    with pytest.raises(ExportError, match="rollout a: prompt_text is null"):
        store.export(sft, as_="sft", columns=["prompt", "prompt_ids"], progress=False)
