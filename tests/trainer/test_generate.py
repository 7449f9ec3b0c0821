"""Tests for trainer.rollout.pipeline: task prompts -> scored, grouped, embedded rollouts in a real store.

Both backends run the same checks; the vLLM one is skipped when ``vllm`` is not installed and
starts exactly one engine for the module.
Run: .venv/bin/python -m pytest -q tests/trainer/test_generate.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import require_vllm

from rolloutstore import RolloutStore
from trainer.models.tiny import make_tiny_model
from trainer.rollout.pipeline import GenerateSummary, generate_rollouts
from trainer.rollout.sampling import SamplingParams
from trainer.store_commands import add_generate_parser, resolve_model
from trainer.tasks import get_task

N_PROMPTS, GROUP, MAX_TOKENS = 8, 4, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gen") / "tiny", task="arith", seed=0)


@pytest.fixture(scope="module")
def vllm_gen(tiny):
    require_vllm()
    from trainer.rollout.vllm import VLLMGenerator

    with VLLMGenerator(tiny, policy_version=3, policy_id="p", seed=0, enforce_eager=True) as gen:
        yield gen


def _check_store(store: RolloutStore, summary: GenerateSummary, *, policy_version: int) -> None:
    task = get_task("arith")
    prompts = {p.prompt_text: p for p in task.make_prompts(N_PROMPTS, 5)}
    table = store.sql(
        "SELECT prompt_text, completion_text, completion_ids, behavior_logprobs, reward, "
        "reward_info, advantage, embedding, group_id, sample_index, policy_version, task, "
        "run_id, num_completion_tokens FROM rollouts"
    ).to_pylist()
    assert len(table) == N_PROMPTS * GROUP == summary.rollouts
    for row in table:
        result = task.reward(prompts[row["prompt_text"]], row["completion_text"])
        assert row["reward"] == pytest.approx(result.reward)
        assert json.loads(row["reward_info"]) == json.loads(json.dumps(result.info, default=str))
        assert len(row["behavior_logprobs"]) == len(row["completion_ids"]) >= 1
        assert len(row["completion_ids"]) <= MAX_TOKENS
        assert all(lp <= 0 for lp in row["behavior_logprobs"])
        emb = np.asarray(row["embedding"])
        assert emb.shape == (store.embedding_dim,)
        assert np.linalg.norm(emb) == pytest.approx(1.0, abs=1e-5)
        assert (row["policy_version"], row["task"], row["run_id"]) == (
            policy_version,
            "arith",
            "r1",
        )

    groups = store.sql(
        "SELECT group_id, count(*) AS n, count(DISTINCT prompt_text) AS np, avg(advantage) AS a, "
        "stddev_pop(reward) AS sd, stddev_pop(advantage) AS sa, "
        "list_sort(list(sample_index)) AS idx FROM rollouts GROUP BY group_id"
    ).to_pylist()
    assert len(groups) == N_PROMPTS
    for g in groups:
        assert (g["n"], g["np"], g["idx"]) == (GROUP, 1, list(range(GROUP)))
        assert abs(g["a"]) < 1e-5
        # GRPO: unit (population) std when rewards differ, all zeros when they do not.
        assert g["sa"] == pytest.approx(1.0 if g["sd"] > 0 else 0.0, abs=1e-3)

    totals = store.sql(
        "SELECT count(*) AS n, sum(num_completion_tokens) AS t, avg(reward) AS r FROM rollouts"
    ).to_pylist()[0]
    assert totals["n"] == summary.rollouts
    assert totals["t"] == summary.tokens
    assert totals["r"] == pytest.approx(summary.mean_reward, abs=1e-6)
    assert summary.tokens_per_s == pytest.approx(summary.tokens / summary.seconds)
    assert summary.store_version == store.version


def _run(store, model, backend: str, **kw) -> GenerateSummary:
    return generate_rollouts(
        store,
        model=model,
        task="arith",
        prompts=N_PROMPTS,
        group_size=GROUP,
        policy_version=kw.pop("policy_version", 2),
        backend=backend,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=5,
        run_id="r1",
        progress=False,
        **kw,
    )


def test_hf_pipeline_lands_in_store(tmp_path, tiny) -> None:
    store = RolloutStore.open(tmp_path / "store", embedding_dim=32)
    v0 = store.version
    # 3 prompts per batch -> 3 appends (3 + 3 + 2 prompts), each one store version.
    summary = _run(store, tiny, "hf", batch_prompts=3)
    _check_store(store, summary, policy_version=2)
    assert store.version - v0 == 3
    assert {r["generator"] for r in store.sql("SELECT generator FROM rollouts").to_pylist()} == {
        "transformers/" + __import__("transformers").__version__
    }


def test_batches_use_distinct_seeds(tmp_path, tiny) -> None:
    store = RolloutStore.open(tmp_path / "store")
    _run(store, tiny, "hf", batch_prompts=4)
    seeds = store.sql("SELECT DISTINCT seed FROM rollouts ORDER BY 1").column("seed").to_pylist()
    assert seeds == [5, 6]


def test_vllm_pipeline_lands_in_store(tmp_path, vllm_gen) -> None:
    store = RolloutStore.open(tmp_path / "store", embedding_dim=48)
    with pytest.raises(ValueError, match="policy_version"):
        _run(store, vllm_gen, "vllm", policy_version=2)
    assert store.count() == 0
    summary = _run(store, vllm_gen, "vllm", batch_prompts=5, policy_version=3)
    _check_store(store, summary, policy_version=3)
    gens = store.sql("SELECT DISTINCT generator, logprobs_mode FROM rollouts").to_pylist()
    assert len(gens) == 1 and gens[0]["generator"].startswith("vllm/")
    assert gens[0]["logprobs_mode"] == "processed_logprobs"


def test_failed_batch_leaves_earlier_batches_only(tmp_path, tiny) -> None:
    class Broken:
        calls = 0

        def __init__(self, inner) -> None:
            self.inner = inner

        def generate(self, prompts, **kw):
            Broken.calls += 1
            if Broken.calls == 2:
                rows = self.inner.generate(prompts, **kw)
                rows[-1]["behavior_logprobs"] = rows[-1]["behavior_logprobs"][:-1] + [float("nan")]
                return rows
            return self.inner.generate(prompts, **kw)

    from trainer.rollout.hf import HFGenerator

    store = RolloutStore.open(tmp_path / "store")
    with pytest.raises(ValueError):
        _run(store, Broken(HFGenerator(tiny)), "hf", batch_prompts=4)
    # The first batch (4 prompts) is committed whole; nothing of the second one is.
    assert store.count() == 4 * GROUP


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"group_size": 0}, "group_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_config_validates(kw, match) -> None:
    base = {"group_size": 2}
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{**base, **kw})


def test_bad_arguments_fail_before_generating(tmp_path) -> None:
    store = RolloutStore.open(tmp_path / "store")
    with pytest.raises(ValueError, match="backend"):
        generate_rollouts(
            store, model="x", task="arith", prompts=2, group_size=2, policy_version=0, backend="tf"
        )
    with pytest.raises(ValueError, match="batch_prompts"):
        generate_rollouts(
            store, model="x", task="arith", prompts=2, group_size=2, policy_version=0,
            backend="hf", batch_prompts=0,
        )  # fmt: skip
    assert store.count() == 0


def test_cli_generate_with_tiny_model(tmp_path, capsys) -> None:
    ap = argparse.ArgumentParser()
    add_generate_parser(ap.add_subparsers(dest="cmd", required=True))
    store_dir = tmp_path / "run" / "store"
    args = ap.parse_args(
        [
            "generate", str(store_dir), "--model", "tiny", "--task", "arith", "--prompts", "3",
            "--group-size", "2", "--policy-version", "4", "--backend", "hf", "--max-tokens", "8",
            "--seed", "1", "--run-id", "cli", "-q",
        ]
    )  # fmt: skip
    args.func(args)
    out = capsys.readouterr().out
    assert "generated 6 rollouts" in out and "tokens/s" in out
    assert (tmp_path / "run" / "tiny-model" / "config.json").is_file()
    store = RolloutStore.open(store_dir, create=False)
    row = store.sql(
        "SELECT count(*) AS n, min(policy_version) AS v, min(run_id) AS r FROM rollouts"
    )
    assert row.to_pylist()[0] == {"n": 6, "v": 4, "r": "cli"}
    # A second run reuses the built model folder.
    assert resolve_model("tiny", store_dir, "arith") == tmp_path / "run" / "tiny-model"


def test_resolve_model_rejects_folder_without_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path / "store", "arith")
