"""The main job: config validation, and SIGKILL + resume == the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import resumable_run_toml, run_draws, trainer_cli, with_eval

from rolloutstore import RolloutStore
from trainer.config import ConfigError, TrainConfig

ROOT = Path(__file__).parents[2]
SMALL = with_eval(
    resumable_run_toml(
        "resume-test",
        """
updates_per_round = 2
batch_size = 8
checkpoint_every = 2
warm_start_steps = 3
""",
    ),
    every=0,
)


# Long context: ~1.5k-token prompts from a file task, packed batches capped by tokens and split
# into micro-batches, so resume must restore the token-budget draws and micro-batch split too.
LONG = """
[model]
num_layers = 1
[task]
name = "file"
options = {{ path = "{long}", reward = "last_int" }}
[generation]
group_size = 2
max_tokens = 4
prompts_per_round = 3
batch_prompts = 3
[replay]
window = 64
seed = 1
[loss]
entropy_coef = 0.01     # rewards start at 0 (zero advantages): keep the weights moving
[optim]
lr = 1e-3
micro_batch_tokens = 2048
[run]
dir = "{dir}"
run_id = "resume-long"
id_time_ms = 1700000000000
steps = {steps}
updates_per_round = 2
batch_size = 8
max_tokens_per_batch = 5000
pack = true
checkpoint_every = 2
warm_start_steps = 1
[eval]
prompts = 0
every = 0
"""


def _long_prompts(path: Path, n: int = 12) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            notes = " ".join(
                f"note {rng.randrange(1000)}: {rng.randrange(10**6)}" for _ in range(120)
            )
            f.write(json.dumps({"prompt": f"{notes}\nQ: {a}+{b} =", "answer": str(a + b)}) + "\n")


def _logged(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["kind"], r["step"], r.get("round")) for r in map(json.loads, lines)]


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[run\]\.stpes: unknown key"):
        TrainConfig.from_dict({"run": {"stpes": 3}})
    with pytest.raises(ConfigError, match=r"\[rnu\]: unknown section"):
        TrainConfig.from_dict({"rnu": {}})
    with pytest.raises(ConfigError, match=r"\[generation\]: temperature must be > 0"):
        TrainConfig.from_dict({"generation": {"temperature": 0}})
    with pytest.raises(ConfigError, match=r"\[loss\]: unknown loss_type"):
        TrainConfig.from_dict({"loss": {"loss_type": "ppo2"}})
    with pytest.raises(ConfigError, match=r"\[replay\]"):
        TrainConfig.from_dict({"replay": {"window": 0}})
    cfg = TrainConfig.from_dict({"replay": {"runs": ["a"]}, "optim": {"betas": [0.9, 0.95]}})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nsteps = -1\n")
    p = trainer_cli("train", str(bad))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "[run]: steps must be >= 1" in err


# Crash points: mid-round (round 2's first of two generation batches committed) and
# between learner steps at a seeded random step that is not a checkpoint.
FAULTS = [
    (SMALL, "generate:2:0"),
    (SMALL, f"step:{random.Random(0).choice([3, 5, 7])}"),
    (LONG, "step:3"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "template,fault", FAULTS, ids=["mid-round", "between-steps", "long-context"]
)
def test_sigkill_and_resume_equal_the_uninterrupted_run(tmp_path, template, fault):
    steps = 8 if template is SMALL else 4
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    _long_prompts(tmp_path / "long.jsonl")
    for d in (ref_dir, crash_dir):
        d.mkdir()
        cfg = template.format(dir=d / "run", steps=steps, long=tmp_path / "long.jsonl")
        (d / "cfg.toml").write_text(cfg)
    ref = trainer_cli("train", str(ref_dir / "cfg.toml"))
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err

    crash = trainer_cli("train", str(crash_dir / "cfg.toml"), fault=fault)
    crash.communicate(timeout=600)
    assert crash.returncode == -signal.SIGKILL  # it really died mid-run
    done = sorted(p.name for p in (crash_dir / "run" / "checkpoints").iterdir())
    assert done[-1] < f"step-{steps:09d}", done
    resumed = trainer_cli("resume", str(crash_dir / "run"))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err

    final = f"checkpoints/step-{steps:09d}/model.safetensors"
    before = f"checkpoints/step-{steps - 2:09d}/model.safetensors"
    want = (ref_dir / "run" / final).read_bytes()
    assert (ref_dir / "run" / before).read_bytes() != want  # training moved the weights
    assert (crash_dir / "run" / final).read_bytes() == want
    assert run_draws(ref_dir / "run") == run_draws(crash_dir / "run")
    # Nothing lost or duplicated in the store: the same rollouts, once each.
    ids = [
        RolloutStore.open(d / "run" / "store")
        .sql("SELECT rollout_id FROM rollouts ORDER BY 1")["rollout_id"]
        .to_pylist()
        for d in (ref_dir, crash_dir)
    ]
    assert ids[0] == ids[1] and len(set(ids[1])) == len(ids[1])
    # The records too: no step drawn (usage) or logged (metrics.jsonl) twice.
    cmp = subprocess.run(
        [sys.executable, "-m", "trainer", "compare", str(ref_dir / "run"), str(crash_dir / "run")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert cmp.returncode == 0 and cmp.stdout.startswith("identical"), cmp.stdout + cmp.stderr
    assert _logged(ref_dir / "run") == _logged(crash_dir / "run")
    if template is LONG:  # the long-context case really ran on long, token-capped batches
        store = RolloutStore.open(crash_dir / "run" / "store")
        assert store.sql("SELECT min(num_prompt_tokens) AS n FROM rollouts")["n"][0].as_py() > 1000
        per_step = [len(v) for v in run_draws(crash_dir / "run").values()]
        assert max(per_step) < 8  # the 5000-token cap, not batch_size, bounded each step


@pytest.mark.slow
def test_sync_run_with_vllm_updates_the_engine_in_place_and_verifies_it(tmp_path):
    from helpers import require_vllm

    require_vllm()
    from trainer.run.sync import train

    cfg = TrainConfig.from_dict(
        {
            "model": {"num_layers": 1},
            "task": {"options": {"max_operands": 2, "max_digits": 1, "ops": ["+"]}},
            "eval": {"prompts": 0},
            "generation": {
                "backend": "vllm",
                "group_size": 4,
                "max_tokens": 5,
                "prompts_per_round": 4,
            },
            "run": {
                "dir": str(tmp_path / "run"),
                "steps": 2,
                "updates_per_round": 1,
                "batch_size": 8,
                "checkpoint_every": 2,
                "warm_start_steps": 2,
            },
        }
    )
    result = train(cfg, progress=False)
    store = RolloutStore.open(result.store, create=False)
    rows = store.sql(
        "SELECT policy_version, any_value(generator) AS g, count(*) AS n FROM rollouts "
        "GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    # One round per learner step, each generated by a vLLM engine holding that version.
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["g"].startswith("vllm/") and r["n"] == 16 for r in rows)
    # One engine start (version 0, from its folder); version 1 went in place, verified.
    events = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    weights = [e for e in events if e["kind"] == "weights"]
    assert [(e["policy_version"], e["engine_starts"], e["in_place_updates"]) for e in weights] == [
        (0, 1, 0),
        (1, 1, 1),
    ]
    assert all(e["max_logprob_gap"] <= 1e-3 for e in weights)
    # Its time: the engine start counts as start-up; the in-place update as a sync, with parts.
    syncs = [e for e in events if e["kind"] == "sync"]
    assert [(e["policy_version"], e["first"]) for e in syncs] == [(0, True), (1, False)]
    update = syncs[1]
    assert update["transfer_seconds"] > 0 and update["verify_seconds"] > 0
    assert update["seconds"] >= update["transfer_seconds"] + update["verify_seconds"]
    assert result.timing["sync_seconds"] == pytest.approx(update["seconds"])
    assert result.timing["startup_seconds"] > syncs[0]["seconds"]
    assert not (tmp_path / "run" / "weights" / "v-000000001").exists()  # no folder, no restart
    assert (tmp_path / "run" / "weights" / "v-000000002" / "model.safetensors").exists()
