"""ingest --from openai of multi-turn chats (tool results, user follow-ups after the first
assistant turn): one schema-v2 trajectory row per chat, token boundaries from rendering
prefixes with the chat template, loss only on assistant tokens, behaviour log-probs
recomputed on those tokens only; exported back with --as messages; trainable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore
from rolloutstore.cli import main as store_main
from rolloutstore.store import layout
from trainer.algo.learner import Learner
from trainer.algo.loss_config import LossConfig
from trainer.algo.optim import OptimConfig
from trainer.cli import main
from trainer.models.load import load_model
from trainer.models.tiny import make_tiny_model
from trainer.rollout.hf import teacher_forced_logprobs

CHATS = Path(__file__).resolve().parents[1] / "data" / "openai_multiturn.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, num_layers=1, num_texts=300, chat_template=True)
    return path


def _ingest(uri, model_dir, *extra) -> int:
    return main(["ingest", str(uri), str(CHATS), "--from", "openai", "-q",
                 "--score-with", str(model_dir), *extra])  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory, model_dir) -> RolloutStore:
    uri = tmp_path_factory.mktemp("mt") / "store"
    assert _ingest(uri, model_dir) == 0
    return RolloutStore.open(uri)


def _rows(store):
    return store.sql("SELECT * FROM rollouts ORDER BY group_id, sample_index").to_pylist()


def test_each_chat_is_one_trajectory_with_turns_and_mask(store, model_dir):
    chats = [json.loads(line) for line in CHATS.read_text().splitlines()]
    rows = {json.loads(r["metadata"])["messages"][-1]["content"] + str(r["sample_index"]): r
            for r in _rows(store)}  # fmt: skip
    assert len(rows) == 4
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for chat in chats[:3]:
        msgs = chat["messages"]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        r = next(r for r in _rows(store) if json.loads(r["metadata"]).get("completion_messages")
                 == msgs[first:])  # fmt: skip
        # The prompt: the turns before the first assistant turn, with the generation prompt.
        assert r["prompt_text"] == tok.apply_chat_template(
            msgs[:first], add_generation_prompt=True, tokenize=False
        )
        whole = tok.apply_chat_template(msgs, tokenize=False)
        assert r["prompt_text"] + r["completion_text"] == whole
        assert tok.decode(r["prompt_ids"] + r["completion_ids"]) == whole
        turns = r["turns"]
        assert [t["role"] for t in turns] == [m["role"] for m in msgs[first:]]
        assert r["num_turns"] == len(turns) and turns[-1]["end"] == len(r["completion_ids"])
        for t, m in zip(turns, msgs[first:]):
            text = tok.decode(r["completion_ids"][t["start"] : t["end"]])
            assert m["content"] in text  # the message's own tokens lie in its turn
            if m["role"] == "assistant":  # the model's part: content + end of turn
                assert text.startswith(m["content"]) and "<|assistant|>" not in text
            else:  # environment: the message and the next assistant header
                assert text.startswith(f"<|{m['role']}|>")
            want = 1 if m["role"] == "assistant" else 0
            assert set(r["loss_mask"][t["start"] : t["end"]]) <= {want}
            assert t["tool_name"] == (m.get("name") if m["role"] == "tool" else None)
        assert r["num_model_tokens"] == sum(r["loss_mask"]) < len(r["completion_ids"])
    single = rows["What is 12*12?1"]
    assert single["turns"] is None and single["num_turns"] == 1
    assert set(single["loss_mask"]) == {1}


def test_logprobs_recomputed_on_model_tokens_only(store, model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for r in _rows(store):
        assert r["logprobs_mode"] == "recomputed"
        with torch.no_grad():
            want = teacher_forced_logprobs(model, r["prompt_ids"], r["completion_ids"], 1.0)
        mask = np.array(r["loss_mask"]) == 1
        got = np.array(r["behavior_logprobs"])
        np.testing.assert_allclose(got[mask], want.numpy()[mask], rtol=1e-5, atol=1e-6)
        assert (got[~mask] == 0.0).all() and (got[mask] < 0).all()


def test_export_as_messages_gives_the_chats_back(store, tmp_path):
    out = tmp_path / "chats.jsonl"
    assert store_main(["export", store.uri, str(out), "--as", "messages", "-q"]) == 0
    got = sorted(json.dumps(json.loads(line)["messages"]) for line in out.read_text().splitlines())
    chats = [json.loads(line) for line in CHATS.read_text().splitlines()]
    strip = [[{"role": m["role"], "content": m["content"]} for m in c["messages"]] for c in chats]
    assert got == sorted(json.dumps(c) for c in strip)


def test_trajectories_replay_and_train(store, model_dir):
    ds = ReplayDataset(store, ReplayConfig(seed=0, where="num_tool_calls > 0"), batch_size=3,
                       learner_version=0, steps=1, record_usage=False)  # fmt: skip
    (batch,) = list(ds)
    rows = {r["rollout_id"]: r for r in _rows(store)}
    assert batch["num_loss_tokens"] == sum(
        rows[i]["num_model_tokens"] for i in batch["rollout_ids"]
    )
    model, _ = load_model(model_dir)
    m = Learner(model, LossConfig(), OptimConfig(lr=1e-3)).step(batch)
    # Scored by the weights that recomputed them: ratio 1 on every trained token.
    assert abs(m["approx_kl"]) < 1e-4 and m["clip_frac_low"] == m["clip_frac_high"] == 0
    assert m["tokens"] == batch["num_loss_tokens"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, model_dir, capsys):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # Hides every assistant turn but the last (like templates that drop past reasoning).
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<|assistant|>\n...\n{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    uri = tmp_path / "store"
    assert _ingest(uri, model_dir, "--tokenizer", str(tmp_path / "tok")) == 2
    err = capsys.readouterr().err
    assert f"{CHATS}:1" in err and "field 'messages'" in err
    assert "cannot place the token boundary before completion message" in err
    assert not uri.exists()


def test_a_v1_store_refuses_trajectories_naming_migrate(tmp_path, model_dir, capsys):
    uri = tmp_path / "old"
    layout.create(str(uri), 64, None, schema_version=1)
    assert _ingest(uri, model_dir) == 2
    err = capsys.readouterr().err
    assert f"rolloutstore migrate {uri}" in err and f"{CHATS}:1" in err
    assert store_main(["migrate", str(uri)]) == 0
    assert _ingest(uri, model_dir) == 0
    assert RolloutStore.open(uri).count() == 4
