"""Resume equals the uninterrupted run, bit for bit, from a kill at any step (issue 20).

A run is killed (an injected fault at a step or inside a generation round) under several
``checkpoint_every`` x ``updates_per_round`` schedules, so that the newest checkpoint may
predate rounds the killed run had already appended, or there is no checkpoint yet; the
resumed run must still end with exactly the uninterrupted run's weights and draws.
Runs are in process (the fault raises instead of SIGKILL: nothing is written on the way
out); tests/trainer/test_train.py covers real SIGKILLs.
"""

from __future__ import annotations

import json
import tomllib

import pytest
from helpers import inject_fault, resumable_run_toml, run_draws, with_eval
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import trainer.run.sync as T
from rolloutstore import RolloutStore
from trainer.cli import main
from trainer.config import TrainConfig

STEPS = 8
RUN = with_eval(
    resumable_run_toml(
        "resume-exact",
        """
updates_per_round = {upr}
batch_size = 8
checkpoint_every = {every}
keep_checkpoints = 10
warm_start_steps = 1
""",
    ),
    every=0,
)


class Killed(BaseException):
    """The injected fault: unwinds the run like a kill (no handler writes anything)."""


def config(run_dir, *, upr: int, every: int) -> TrainConfig:
    text = RUN.format(dir=run_dir, steps=STEPS, upr=upr, every=every)
    return TrainConfig.from_dict(tomllib.loads(text))


def final(run_dir) -> tuple[bytes, dict, dict]:
    """Final weights, generation totals, and each round's last logged (rollouts, tokens, reward)."""
    ckpt = run_dir / "checkpoints" / f"step-{STEPS:09d}"
    totals = json.loads((ckpt / "state.json").read_text())["totals"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = {
        r["round"]: (r["rollouts"], r["tokens"], r["reward"])
        for r in records
        if r["kind"] == "generate"
    }
    counts = {k: v for k, v in totals.items() if not k.endswith("seconds")}
    return (ckpt / "model.safetensors").read_bytes(), counts, rounds


def run_killed_then_resumed(run_dir, cfg: TrainConfig, fault: str, monkeypatch) -> None:
    def fault_hook(where: str) -> None:
        if where == fault:
            raise Killed(where)

    with monkeypatch.context() as m:
        inject_fault(m, fault_hook)
        with pytest.raises(Killed):
            T.train(cfg, progress=False)
    T.train(cfg, resume=True, progress=False)


_REFERENCE: dict[int, tuple] = {}


def reference(tmp_path_factory, upr: int) -> tuple:
    """The uninterrupted run's :func:`final` and draws (checkpoints do not change them)."""
    if upr not in _REFERENCE:
        run_dir = tmp_path_factory.mktemp(f"ref-y{upr}") / "run"
        T.train(config(run_dir, upr=upr, every=STEPS), progress=False)
        _REFERENCE[upr] = final(run_dir), run_draws(run_dir)
    return _REFERENCE[upr]


SCHEDULES = [(5, 2), (3, 2), (4, 3), (5, 1)]  # (checkpoint_every, updates_per_round)


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,  # the same kills on every machine; the examples below always run
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is two runs
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    schedule=st.sampled_from(SCHEDULES),
    fault=st.one_of(
        st.integers(1, STEPS).map(lambda s: f"step:{s}"),
        st.integers(0, 3).map(lambda r: f"generate:{r}:0"),
    ),
)
@example(schedule=(5, 2), fault="step:7")  # round 3 appended after the step-5 checkpoint
@example(schedule=(5, 1), fault="step:8")  # two rounds appended after it
@example(schedule=(5, 2), fault="generate:3:0")  # half of round 3 appended after it
@example(schedule=(4, 3), fault="step:4")  # no checkpoint yet, rounds 0 and 1 appended
def test_resume_after_a_kill_equals_the_uninterrupted_run(
    tmp_path_factory, monkeypatch, schedule, fault
):
    every, upr = schedule
    (want_weights, want_totals, want_rounds), want_draws = reference(tmp_path_factory, upr)
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    cfg = config(run_dir, upr=upr, every=every)
    run_killed_then_resumed(run_dir, cfg, fault, monkeypatch)
    weights, totals, rounds = final(run_dir)
    assert weights == want_weights
    assert run_draws(run_dir) == want_draws
    # A round the killed run appended counts as generated (token budget, controller reward).
    assert totals == want_totals
    assert rounds == want_rounds


def records(run_dir) -> tuple[list, list, dict]:
    """What a run recorded: every usage row (learner step, rollout id), each metrics record's
    (kind, step, round), and the steps of each TensorBoard scalar tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    usage = (
        RolloutStore.open(run_dir / "store", create=False)
        .sql("SELECT learner_step, rollout_id FROM usage ORDER BY 1, 2")
        .to_pylist()
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [(r["kind"], r["step"], r.get("round")) for r in lines]
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return usage, metrics, tb


def test_records_after_a_kill_equal_the_uninterrupted_runs(tmp_path, monkeypatch, capsys):
    # Killed at step 7: the newest checkpoint is step 5, steps 6-7 and round 3 are redone.
    ref_dir, run_dir = tmp_path / "ref" / "run", tmp_path / "killed" / "run"
    T.train(config(ref_dir, upr=2, every=5), progress=False)
    run_killed_then_resumed(run_dir, config(run_dir, upr=2, every=5), "step:7", monkeypatch)
    usage, metrics, tb = records(run_dir)
    want_usage, want_metrics, want_tb = records(ref_dir)
    assert len(usage) == len(want_usage) and usage == want_usage  # no step recorded twice
    assert metrics == want_metrics
    assert tb == want_tb and tb["train/loss"] == list(range(1, STEPS + 1))
    # `rolloutstore-train compare` says so, and names the first difference when there is one.
    assert main(["compare", str(ref_dir), str(run_dir)]) == 0
    assert "identical: 8 learner steps" in capsys.readouterr().out
    ids = [r["rollout_id"] for r in want_usage if r["learner_step"] == 3]
    RolloutStore.open(run_dir / "store").record_usage(ids[:1], 3, run_id="resume-exact")
    with pytest.raises(SystemExit) as exit:
        main(["compare", str(ref_dir), str(run_dir)])
    assert exit.value.code == 1
    out = capsys.readouterr().out
    assert "first difference: learner step 3: usage rows 8 (A) vs 9 (B)" in out
