"""Tests for trainer.rollout.pipeline: task prompts -> scored, grouped, embedded rollouts in a real store.

Both backends run the same checks; the vLLM one is skipped when ``vllm`` is not installed and
starts exactly one engine for the module.
Run: .venv/bin/python -m pytest -q tests/trainer/test_generate.py
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
from helpers import require_vllm

from rolloutstore import RolloutStore
from rolloutstore.options import field_default
from trainer.config import TaskConfig
from trainer.models.tiny import make_tiny_model
from trainer.rollout.pipeline import GenerateSummary, RoundIds, generate_rollouts
from trainer.rollout.sampling import GenerationConfig, SamplingParams
from trainer.store_commands import (
    GENERATE_SKIPS,
    GENERATE_TASK_KEYS,
    add_generate_parser,
    generate_config,
    resolve_model,
)
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


def _run(store, model, backend: str, policy_version: int = 2, **kw) -> GenerateSummary:
    generation = GenerationConfig(
        backend=backend, group_size=GROUP, temperature=1.0, max_tokens=MAX_TOKENS, **kw
    )
    return generate_rollouts(
        store, model, "arith", N_PROMPTS, generation=generation, policy_version=policy_version,
        ids=RoundIds(run_id="r1", seed=5), progress=False,
    )  # fmt: skip


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

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def generate_samples(self, prompts, **kw):
            Broken.calls += 1
            if Broken.calls == 2:
                samples = self.inner.generate_samples(prompts, **kw)
                bad = samples[-1]
                samples[-1] = replace(bad, logprobs=bad.logprobs[:-1] + [float("nan")])
                return samples
            return self.inner.generate_samples(prompts, **kw)

    from trainer.rollout.hf import HFGenerator

    store = RolloutStore.open(tmp_path / "store")
    with pytest.raises(ValueError):
        _run(store, Broken(HFGenerator(tiny)), "hf", policy_version=0, batch_prompts=4)
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
            store, "x", "arith", 2, generation=GenerationConfig(backend="tf"), policy_version=0
        )
    with pytest.raises(ValueError, match="batch_prompts"):
        generate_rollouts(
            store, "x", "arith", 2, generation=GenerationConfig(batch_prompts=0), policy_version=0
        )
    with pytest.raises(ValueError, match="policy_version"):
        generate_rollouts(store, "x", "arith", 2, generation=GenerationConfig(), policy_version=-1)
    with pytest.raises(ValueError, match="run_id"):
        generate_rollouts(
            store, "x", "arith", 2, generation=GenerationConfig(), policy_version=0,
            ids=RoundIds(run_id=""),
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


# -- generate's options are the run config's [generation] (and [task]) keys ----------------------
def _generate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    return add_generate_parser(ap.add_subparsers(dest="cmd", required=True))


def _drift(parser: argparse.ArgumentParser) -> list[str]:
    """Each option shared with the run config whose default (in the parser, in its --help, or
    in the config the command builds) is not the config dataclass's."""
    shared = [(TaskConfig, f) for f in fields(TaskConfig) if f.name in GENERATE_TASK_KEYS]
    shared += [(GenerationConfig, f) for f in fields(GenerationConfig)]
    shared = [(c, f) for c, f in shared if f.name not in GENERATE_SKIPS]
    actions = {a.dest: a for a in parser._actions}
    text = " ".join(parser.format_help().split())
    task, _, gen = generate_config(parser.parse_args(["STORE", "--model", "tiny"]))
    built = {TaskConfig: task, GenerationConfig: gen}
    problems = []
    for cls, f in shared:
        want, action = field_default(f), actions.get(f.name)
        if action is None:
            problems.append(f"{f.name}: no option")
            continue
        if action.default is not argparse.SUPPRESS and action.default != want:
            problems.append(f"{f.name}: parser default {action.default!r} != {want!r}")
        help_text = " ".join(action.help.split())
        if not help_text.endswith(f"(default: {want})") or help_text not in text:
            problems.append(f"{f.name}: --help says {help_text!r}, the config {want!r}")
        if getattr(built[cls], f.name) != want:
            problems.append(f"{f.name}: builds {getattr(built[cls], f.name)!r} != {want!r}")
    return problems


def test_generate_defaults_are_the_run_configs() -> None:
    assert _drift(_generate_parser()) == []
    # The two defaults that used to disagree with [generation].
    assert (GenerationConfig().backend, GenerationConfig().max_tokens) == ("hf", 16)


def test_the_drift_check_catches_a_hand_copied_default() -> None:
    drifted = _generate_parser()
    drifted.set_defaults(max_tokens=64)  # as the hand-copied flag had it
    assert [p for p in _drift(drifted) if p.startswith("max_tokens:")]


def test_generate_keeps_its_option_names() -> None:
    names = {s for a in _generate_parser()._actions for s in a.option_strings}
    assert {
        "--model", "--task", "--prompts", "--group-size", "--policy-version", "--policy-id",
        "--backend", "--temperature", "--top-p", "--top-k", "--max-tokens", "--tools",
        "--max-turns", "--max-total-tokens", "--seed", "--batch-prompts", "--run-id", "-q",
    } <= names  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--max-model-len", "8"], "--max-model-len = 8 leaves no room"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--max-turns", "2"], "--max-turns = 2 needs --tools"),
    ],
)
def test_cli_generate_refuses_bad_settings_before_writing(tmp_path, capsys, extra, needle) -> None:
    from trainer.cli import main

    assert main(["generate", str(tmp_path / "run" / "store"), "--model", "tiny", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
    assert not (tmp_path / "run").exists()  # no store, no tiny model


def test_generate_zero_top_k_and_one_top_p_are_off() -> None:
    args = _generate_parser().parse_args(["S", "--model", "tiny", "--top-k", "0", "--top-p", "1"])
    _, _, gen = generate_config(args)
    assert (gen.top_k, gen.top_p) == (None, None) and gen == GenerationConfig()
