"""export --as messages: each rollout as one conversation in the OpenAI / TRL conversational
format (``messages``: {"role", "content"} turns, plus reward), loaded back with Hugging Face
``datasets``; and --as rollouts keeps the multi-turn columns through a round trip."""

from __future__ import annotations

import json

import pytest

from rolloutstore import RolloutStore
from rolloutstore.cli import main
from rolloutstore.errors import ExportError

datasets = pytest.importorskip("datasets")

WORDS = ["[UNK]", "<calc>", "6*7", "</calc>", "42", "so", "it", "is", "done"]
PROMPT = [{"role": "system", "content": "Use the calculator."},
          {"role": "user", "content": "What is 6*7?"}]  # fmt: skip
DONE = [{"role": "assistant", "content": "<calc>6*7</calc>"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "so it is 42"}]  # fmt: skip
TURNS = [{"role": "assistant", "start": 0, "end": 3},
         {"role": "tool", "start": 3, "end": 4, "tool_name": "calculator"},
         {"role": "assistant", "start": 4, "end": 8}]  # fmt: skip


def _ids(text: str) -> list[int]:
    return [
        WORDS.index(w)
        for w in text.replace("<calc>", "<calc> ").replace("</calc>", " </calc>").split()
    ]


def _rows() -> list[dict]:
    ids = [i for m in DONE for i in _ids(m["content"])]
    assert len(ids) == 8
    base = {"policy_version": 0, "prompt_ids": [1, 2],
            "completion_ids": ids, "behavior_logprobs": [-0.5, -0.5, -0.5, 0.0] + [-0.5] * 4,
            "loss_mask": [1, 1, 1, 0, 1, 1, 1, 1], "turns": TURNS}  # fmt: skip
    return [
        {"rollout_id": "a-text", "prompt_ids": [1], "completion_ids": [4],
         "behavior_logprobs": [-0.1], "policy_version": 0, "prompt_text": "What is 6*7?",
         "completion_text": "42", "reward": 1.0},
        {"rollout_id": "b-chat", "prompt_ids": [1], "completion_ids": [4],
         "behavior_logprobs": [-0.1], "policy_version": 0, "completion_text": "42",
         "metadata": json.dumps({"messages": PROMPT}), "reward": 0.5},
        {**base, "rollout_id": "c-kept", "reward": 1.0, "completion_text": "<calc>6*7</calc>42so",
         "metadata": json.dumps({"messages": PROMPT, "completion_messages": DONE})},
        {**base, "rollout_id": "d-ids", "reward": 0.0, "prompt_text": "What is 6*7?",
         "completion_text": "<calc> 6*7 </calc> 42 so it is 42"},
    ]  # fmt: skip


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    s = RolloutStore.open(tmp_path / "store", embedding_dim=4)
    s.append(_rows())
    return s


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level tokenizer folder (transformers' format) over WORDS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    path = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_multi_turn_rows_without_turn_text_need_a_tokenizer(store, tmp_path, capsys):
    with pytest.raises(ExportError) as info:
        store.export(tmp_path / "m.jsonl", as_="messages", progress=False)
    msg = str(info.value)
    assert "rollout d-ids" in msg and "3 turns" in msg and "--tokenizer DIR" in msg
    assert not (tmp_path / "m.jsonl").exists()
    rc = main(["export", store.uri, str(tmp_path / "m.jsonl"), "--as", "messages", "-q"])
    assert rc == 2 and "rollout d-ids" in capsys.readouterr().err
    with pytest.raises(ExportError, match="--tokenizer applies to --as messages only"):
        store.export(tmp_path / "s.jsonl", as_="sft", tokenizer=tmp_path, progress=False)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_messages_load_with_datasets_in_trl_conversational_format(
    store, tmp_path, tokenizer_dir, fmt
):
    out = tmp_path / f"m.{fmt}"
    rc = main(["export", store.uri, str(out), "--as", "messages", "--tokenizer",
               str(tokenizer_dir), "-q"])  # fmt: skip
    assert rc == 0
    ds = datasets.load_dataset("json" if fmt == "jsonl" else "parquet", data_files=str(out),
                               split="train")  # fmt: skip
    assert ds.column_names == ["messages", "reward", "rollout_id", "prompt_id", "num_turns"]
    rows = {r["rollout_id"]: r for r in ds}
    assert rows["a-text"]["messages"] == [
        {"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "42"},
    ]  # fmt: skip
    assert rows["b-chat"]["messages"] == PROMPT + [{"role": "assistant", "content": "42"}]
    assert rows["c-kept"]["messages"] == PROMPT + DONE  # the stored turns' text
    decoded = rows["d-ids"]["messages"]  # each turn's token ids, decoded
    assert [m["role"] for m in decoded] == ["user", "assistant", "tool", "assistant"]
    assert [m["content"] for m in decoded[1:]] == ["<calc> 6*7 </calc>", "42", "so it is 42"]
    assert rows["d-ids"]["num_turns"] == 3 and rows["d-ids"]["reward"] == 0.0
    trl = pytest.importorskip("trl.data_utils")
    assert all(trl.is_conversational({"messages": r["messages"]}) for r in ds)


def test_messages_columns_and_where(store, tmp_path):
    out = tmp_path / "m.jsonl"
    r = store.export(out, as_="messages", columns=["messages", "reward"],
                     where="num_turns = 1", progress=False)  # fmt: skip
    assert r.rows == 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sorted(x) for x in lines] == [["messages", "reward"]] * 2
    with pytest.raises(ExportError, match="unknown column"):
        store.export(out, as_="messages", columns=["prompt"], progress=False)


def test_rollouts_export_keeps_turns_and_ingests_back_identically(store, tmp_path):
    out = tmp_path / "r.parquet"
    store.export(out, progress=False)
    import pyarrow.parquet as pq

    t = pq.read_table(out)
    assert {"loss_mask", "turns", "num_turns", "num_model_tokens", "tools"} <= set(t.column_names)
    copy = RolloutStore.open(tmp_path / "copy", embedding_dim=4)
    assert main(["ingest", copy.uri, str(out), "-q"]) == 0
    q = "SELECT * EXCLUDE (created_at) FROM rollouts ORDER BY rollout_id"
    assert copy.sql(q).equals(store.sql(q))
    got = copy.sql("SELECT loss_mask, turns FROM rollouts WHERE rollout_id = 'd-ids'").to_pylist()
    assert got[0]["loss_mask"] == [1, 1, 1, 0, 1, 1, 1, 1]
    assert [x["tool_name"] for x in got[0]["turns"]] == [None, "calculator", None]


def test_sft_and_dpo_refuse_trajectories_without_their_own_messages(store, tmp_path, capsys):
    for shape in ("sft", "dpo"):
        out = tmp_path / f"{shape}.jsonl"
        with pytest.raises(ExportError) as info:
            store.export(out, as_=shape, progress=False)
        msg = str(info.value)
        # d-ids has no per-turn text; c-kept has, but a mixed (not all-chat) export writes
        # text completions, where its turns cannot be kept apart either.
        assert "2 selected row(s) are multi-turn" in msg and "rollout c-kept" in msg
        assert "--as messages" in msg and not out.exists()
        rc = main(["export", store.uri, str(out), "--as", shape, "-q"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "multi-turn trajectories" in err and "\n" not in err
    r = store.export(tmp_path / "one.jsonl", as_="sft", where="num_turns = 1", progress=False)
    assert r.rows == 1  # a-text and b-chat share a prompt: its best completion


def test_sft_and_dpo_write_a_kept_trajectory_as_its_messages(tmp_path):
    s = RolloutStore.open(tmp_path / "store", embedding_dim=4)
    rows = [r for r in _rows() if r["rollout_id"] == "c-kept"]
    worse = [{"role": "assistant", "content": "<calc>6*7</calc>"},
             {"role": "tool", "content": "42"},
             {"role": "assistant", "content": "so it is 41"}]  # fmt: skip
    meta = json.dumps({"messages": PROMPT, "completion_messages": worse})
    rows.append({**rows[0], "rollout_id": "e-worse", "reward": 0.0, "metadata": meta})
    for r in rows:
        r.update(group_id="g", prompt_id="p")
    s.append(rows)
    r = s.export(tmp_path / "sft.jsonl", as_="sft", progress=False)
    assert r.rows == 1
    (sft,) = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert sft["prompt"] == PROMPT and sft["completion"] == DONE
    assert sft["messages"] == PROMPT + DONE and sft["rollout_id"] == "c-kept"
    s.export(tmp_path / "dpo.jsonl", as_="dpo", progress=False)
    (dpo,) = [json.loads(x) for x in (tmp_path / "dpo.jsonl").read_text().splitlines()]
    assert dpo["prompt"] == PROMPT and dpo["chosen"] == DONE and dpo["rejected"] == worse
    trl = pytest.importorskip("trl.data_utils")
    assert trl.is_conversational(sft) and trl.is_conversational(dpo)


@pytest.mark.parametrize("what", ["corrupt tokenizer.json", "config a list", "empty", "/etc"])
def test_a_tokenizer_folder_that_does_not_load_is_one_error_line(store, tmp_path, capsys, what):
    tok = tmp_path / "tok"
    if what == "/etc":
        tok = "/etc"
    else:
        tok.mkdir()
        if what == "corrupt tokenizer.json":
            (tok / "tokenizer.json").write_text('{"version": "1.0", "model": {')
        elif what == "config a list":
            (tok / "tokenizer_config.json").write_text("[1, 2]")
    out = tmp_path / "m.jsonl"
    rc = main(["export", store.uri, str(out), "--as", "messages", "--tokenizer", str(tok), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith(f"error: --tokenizer {tok}: not a tokenizer folder transformers can load")
    assert not out.exists()
