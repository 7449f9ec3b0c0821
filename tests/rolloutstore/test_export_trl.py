"""export --as sft|dpo in TRL's dataset names, loaded back with Hugging Face ``datasets``.

TRL's "Dataset formats and types" doc: prompt-completion {"prompt", "completion"},
preference {"prompt", "chosen", "rejected"}; conversational data holds lists of
{"role", "content"} turns in those columns, and language modeling uses {"messages"}.
"""

from __future__ import annotations

import json

import pytest

from rolloutstore import RolloutStore
from rolloutstore.cli import main

datasets = pytest.importorskip("datasets")


def _rows(chat: bool) -> list[dict]:
    rows = []
    for g, question in enumerate(["What is 1+1?", "What is 2+2?"]):
        for k, (answer, reward) in enumerate([("2" if g == 0 else "4", 1.0), ("5", 0.0)]):
            turns = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": question},
            ]
            rows.append({
                "rollout_id": f"g{g}-{k}", "group_id": f"g{g}", "sample_index": k,
                "prompt_ids": [1, 2, 3 + g], "completion_ids": [7, 8 + k],
                "behavior_logprobs": [-0.5, -0.25], "policy_version": 0,
                "prompt_text": f"<|user|>\n{question}\n<|assistant|>\n", "completion_text": answer,
                "reward": reward, "advantage": 1.0 if reward else -1.0,
                "metadata": json.dumps({"messages": turns} if chat else {"answer": answer}),
            })  # fmt: skip
    return rows


def _load(path, fmt):
    if fmt == "hf":
        return datasets.load_from_disk(str(path))
    kind = "json" if fmt == "jsonl" else "parquet"
    return datasets.load_dataset(kind, data_files=str(path), split="train",
                                 cache_dir=str(path) + ".cache")  # fmt: skip


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "hf"])
def test_sft_and_dpo_standard_text(tmp_path, fmt):
    store = RolloutStore.open(tmp_path / "s")
    store.append(_rows(chat=False))
    ext = {"parquet": ".parquet", "jsonl": ".jsonl", "hf": ""}[fmt]
    sft, dpo = tmp_path / f"sft{ext}", tmp_path / f"dpo{ext}"
    assert main(["export", store.uri, str(sft), "--as", "sft", "--format", fmt, "-q"]) == 0
    assert main(["export", store.uri, str(dpo), "--as", "dpo", "--format", fmt, "-q"]) == 0

    ds = _load(sft, fmt)
    assert ds.column_names[:2] == ["prompt", "completion"]
    assert "messages" not in ds.column_names
    assert sorted(ds["completion"]) == ["2", "4"]  # the best completion per prompt
    assert ds[0]["prompt"] == "<|user|>\nWhat is 1+1?\n<|assistant|>\n"

    ds = _load(dpo, fmt)
    assert ds.column_names[:3] == ["prompt", "chosen", "rejected"]
    assert ds["chosen"] == ["2", "4"] and ds["rejected"] == ["5", "5"]
    assert ds["chosen_reward"] == [1.0, 1.0]


def test_sft_and_dpo_conversational(tmp_path):
    store = RolloutStore.open(tmp_path / "s")
    store.append(_rows(chat=True))
    sft, dpo = tmp_path / "sft.parquet", tmp_path / "dpo.jsonl"
    assert main(["export", store.uri, str(sft), "--as", "sft", "-q"]) == 0
    assert main(["export", store.uri, str(dpo), "--as", "dpo", "-q"]) == 0

    ds = _load(sft, "parquet")
    assert ds.column_names[:3] == ["prompt", "completion", "messages"]
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "What is 1+1?"}
    assert ds[0]["prompt"] == [system, user]
    assert ds[0]["completion"] == [{"role": "assistant", "content": "2"}]
    assert ds[0]["messages"] == [system, user, {"role": "assistant", "content": "2"}]

    ds = _load(dpo, "jsonl")
    assert ds.column_names[:3] == ["prompt", "chosen", "rejected"]
    assert ds[1]["prompt"][-1] == {"role": "user", "content": "What is 2+2?"}
    assert ds[1]["chosen"] == [{"role": "assistant", "content": "4"}]
    assert ds[1]["rejected"] == [{"role": "assistant", "content": "5"}]

    # Only the conversational turns, as a language-modeling dataset.
    lm = tmp_path / "lm.parquet"
    assert main(["export", store.uri, str(lm), "--as", "sft", "--columns", "messages", "-q"]) == 0
    ds = _load(lm, "parquet")
    assert ds.column_names == ["messages"] and ds[1]["messages"][-1]["content"] == "4"


def test_messages_refused_for_text_rows(tmp_path, capsys):
    store = RolloutStore.open(tmp_path / "s")
    store.append(_rows(chat=False))
    out = tmp_path / "o.parquet"
    assert main(["export", store.uri, str(out), "--as", "sft", "--columns", "messages"]) == 2
    assert "needs conversational rows" in capsys.readouterr().err
    assert not out.exists()
