"""Long agent trajectories (issue #17, item 5): 8-16k-token multi-turn rows in a real run.

Chats of ~10 tool calls, each answered by a ~1k-token tool reply, are ingested
(``ingest --from openai --score-with``: behaviour log-probs recomputed on the assistant
tokens) into a store that a training run replays (``[run] sources``) next to its own short
rollouts, packed and capped at ``max_tokens_per_batch``. The run is SIGKILLed between
learner steps and resumed: weights and draws must equal the uninterrupted run's, bit for
bit. Peak RSS of the runs is printed (``-s``; docs/benchmarks.md, "Long trajectories").
"""

from __future__ import annotations

import json
import random
import resource
import signal
from pathlib import Path

import pytest
from helpers import run_draws, trainer_cli

from rolloutstore import RolloutStore
from trainer.cli import main as train_main

STEPS, CAP = 4, 16384

RUN = """
[model]
path = "{model}"
[task]
name = "file"
options = {{ path = "{prompts}", reward = "last_int" }}
[generation]
group_size = 2
max_tokens = 4
prompts_per_round = 3
batch_prompts = 3
[replay]
window = 64
seed = 1
[loss]
entropy_coef = 0.01
[optim]
lr = 1e-3
micro_batch_tokens = 4096
[run]
dir = "{dir}"
run_id = "long-multiturn"
id_time_ms = 1700000000000
steps = {steps}
updates_per_round = 2
batch_size = 8
max_tokens_per_batch = {cap}
pack = true
checkpoint_every = 2
warm_start_steps = 1
sources = ["{source}"]
[eval]
prompts = 0
every = 0
"""


def _chats(path: Path, n: int, calls: int, rng: random.Random) -> None:
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(100), rng.randrange(100)
            msgs = [{"role": "user", "content": f"Find the totals in the log, then {a}+{b}."}]
            for _ in range(calls):
                x, y = rng.randrange(1000), rng.randrange(1000)
                msgs.append({"role": "assistant", "content": f"<calc>{x}+{y}</calc>"})
                log = " ".join(
                    f"row {rng.randrange(1000)}: {rng.randrange(10**6)}" for _ in range(75)
                )
                msgs.append({"role": "tool", "name": "calculator", "content": f"={x + y} {log}"})
            msgs.append({"role": "assistant", "content": f"so {a + b}"})
            f.write(json.dumps({"messages": msgs, "reward": 1.0}) + "\n")


def _prompts(path: Path, rng: random.Random) -> None:
    with open(path, "w") as f:
        for _ in range(12):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b} =", "answer": str(a + b)}) + "\n")


@pytest.fixture(scope="module")
def long_source(tmp_path_factory):
    from trainer.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("long_mt")
    model = make_tiny_model(
        tmp / "model", num_layers=1, num_texts=300, chat_template=True,
        max_position_embeddings=CAP,
    )  # fmt: skip
    rng = random.Random(0)
    _chats(tmp / "chats.jsonl", 4, 10, rng)
    _prompts(tmp / "prompts.jsonl", rng)
    args = ["ingest", str(tmp / "source"), str(tmp / "chats.jsonl"), "--from", "openai", "-q"]
    assert train_main([*args, "--score-with", str(model)]) == 0
    return tmp, model


@pytest.mark.slow
def test_long_trajectories_train_packed_capped_and_resume_bitwise_after_sigkill(long_source):
    tmp, model = long_source
    source = RolloutStore.open(tmp / "source", create=False)
    lengths = source.sql(
        "SELECT num_prompt_tokens + num_completion_tokens AS n, num_turns, num_model_tokens "
        "FROM rollouts"
    ).to_pylist()
    assert all(8000 <= r["n"] <= CAP and r["num_turns"] == 21 for r in lengths), lengths
    assert all(r["num_model_tokens"] < r["n"] / 10 for r in lengths)  # mostly tool tokens

    dirs = {}
    for name in ("ref", "crash"):
        d = tmp / name
        d.mkdir()
        text = RUN.format(model=model, prompts=tmp / "prompts.jsonl", dir=d / "run",
                          steps=STEPS, cap=CAP, source=tmp / "source")  # fmt: skip
        (d / "cfg.toml").write_text(text)
        dirs[name] = d
    ref = trainer_cli("train", str(dirs["ref"] / "cfg.toml"))
    _, err = ref.communicate(timeout=900)
    assert ref.returncode == 0, err
    crash = trainer_cli("train", str(dirs["crash"] / "cfg.toml"), fault="step:3")
    crash.communicate(timeout=900)
    assert crash.returncode == -signal.SIGKILL
    resumed = trainer_cli("resume", str(dirs["crash"] / "run"))
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"\nlong multi-turn run: peak RSS of a training process {peak_mb:.0f} MB")

    final = f"checkpoints/step-{STEPS:09d}/model.safetensors"
    want = (dirs["ref"] / "run" / final).read_bytes()
    assert (dirs["crash"] / "run" / final).read_bytes() == want
    draws = run_draws(dirs["ref"] / "run")
    assert draws == run_draws(dirs["crash"] / "run")
    # The steps really trained on the long trajectories, under the token cap.
    store = RolloutStore.open(dirs["crash"] / "run" / "store", create=False)
    sizes = {
        r["rollout_id"]: (r["n"], r["num_turns"])
        for r in store.sql(
            "SELECT rollout_id, num_prompt_tokens + num_completion_tokens AS n, num_turns "
            "FROM rollouts"
        ).to_pylist()
    }
    long_steps = 0
    for ids in draws.values():
        tokens = sum(sizes[i][0] for i in ids)
        assert tokens <= CAP
        long_steps += any(sizes[i][1] > 1 and sizes[i][0] >= 8000 for i in ids)
    assert long_steps >= 2, draws
