"""Distributed learners: ``torchrun --nproc-per-node 2 -m trainer ...`` on CPU (gloo).

One uninterrupted 2-rank run is the reference for every test: the ranks' weights stay
identical, each step's selection is split disjointly between them, only rank 0 writes, a run
whose rank 1 is SIGKILLed resumes (with 2 ranks only) to the same bits, and the 2-rank step
equals the 1-process step on the same global batch up to float summation order. The FSDP
run (``--set run.fsdp=true``) is checked against DDP (same selections, same clipped steps), for
rank-0-only writes of the gathered weights, and for a bit-exact resume after a SIGKILL.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN_TOML, with_eval
from safetensors.torch import load_file

from rolloutstore import RolloutStore

ROOT = Path(__file__).parents[2]
STEPS, ROUND = 6, 3  # two generation rounds; checkpoints after each
CONFIG = with_eval(
    TINY_RUN_TOML
    + """
[loss]
entropy_coef = 0.01  # a gradient at every step even while every reward is 0
[optim]
lr = 1e-3
micro_batch_tokens = 24  # several micro-batches per rank: DDP syncs only the last one
[run]
dir = "{dir}"
run_id = "ddp-test"
ids = "clock"  # the run id and id_time_ms make the ids: runs of other lengths share them
id_time_ms = 1700000000000
steps = {steps}
updates_per_round = 3
batch_size = 8
checkpoint_every = 3
keep_checkpoints = 5
warm_start_steps = 3
""",
    every=0,
)


def _launch(args: list[str], *, ranks: int, trace: Path | None = None, fault: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ROLLOUTSTORE_FAULT"):
        env.pop(k, None)
    if trace is not None:
        env["ROLLOUTSTORE_RANK_TRACE"] = str(trace)
    if fault is not None:
        env["ROLLOUTSTORE_FAULT"], env["ROLLOUTSTORE_FAULT_RANK"] = fault, "1"
    launcher = [sys.executable]
    if ranks > 1:  # torchrun, as a module of this interpreter; --standalone picks a free port
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*launcher, "-m", "trainer", *args, "-q"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _config(folder: Path, steps: int = STEPS) -> Path:
    folder.mkdir(parents=True)
    path = folder / "cfg.toml"
    path.write_text(CONFIG.format(dir=folder / "run", steps=steps))
    return path


def _trace(folder: Path) -> dict[int, list[dict]]:
    """rank -> its per-step records (step, rollout_ids, weights_sha256)."""
    return {
        int(f.stem.split("-")[1]): [json.loads(line) for line in f.read_text().splitlines()]
        for f in folder.glob("rank-*.jsonl")
    }


def _digest(path: Path) -> str:
    """SHA-256 of a checkpoint's tensors: names sorted, each followed by its raw bits."""
    tensors = load_file(str(path))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def _usage(run_dir: Path, distinct: bool = False) -> dict[int, list[str]]:
    """learner step -> rollout ids in the usage log (``distinct``: a crashed run's re-draws once)."""
    rows = (
        RolloutStore.open(run_dir / "store", create=False)
        .sql(
            f"SELECT {'DISTINCT' if distinct else ''} learner_step, rollout_id FROM usage "
            "ORDER BY 1, 2"
        )
        .to_pylist()
    )
    out: dict[int, list[str]] = {}
    for r in rows:
        out.setdefault(r["learner_step"], []).append(r["rollout_id"])
    return out


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:09d}" / "model.safetensors"


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run (its folder holds run/ and trace/)."""
    folder = tmp_path_factory.mktemp("ddp") / "ref"
    p = _launch(["train", str(_config(folder))], ranks=2, trace=folder / "trace")
    assert p.returncode == 0, p.stderr[-4000:]
    return folder


@pytest.mark.slow
def test_two_ranks_hold_identical_weights_and_split_each_selection(ref):
    trace, run = _trace(ref / "trace"), ref / "run"
    assert sorted(trace) == [0, 1] and all(len(t) == STEPS for t in trace.values())
    usage = _usage(run)
    assert sorted(usage) == list(range(STEPS))
    for a, b in zip(trace[0], trace[1]):
        step = a["step"]
        assert a["weights_sha256"] == b["weights_sha256"], f"ranks diverged at step {step}"
        mine, theirs = a["rollout_ids"], b["rollout_ids"]
        assert len(mine) == len(theirs) == 4 and not set(mine) & set(theirs)
        # Together they are the one selection of that step, recorded once (by rank 0).
        assert sorted(mine + theirs) == usage[step - 1]
    # The checkpoints rank 0 wrote hold the weights every rank trained to.
    for step in (ROUND, STEPS):
        assert _digest(_ckpt(run, step)) == trace[1][step - 1]["weights_sha256"]
    assert _digest(_ckpt(run, ROUND)) != _digest(_ckpt(run, STEPS))  # the weights do move

    # Only rank 0 writes: one metrics record per step (over the global batch), one
    # TensorBoard event file, each round generated and appended once.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = _train_records(run)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["sequences"] == 8 and r["learner_ranks"] == 2 for r in train)
    assert all(r["micro_batches"] > 2 for r in train)  # more than one on some rank
    assert [r["round"] for r in records if r["kind"] == "generate"] == [0, 1]
    assert len(list((run / "tb").iterdir())) == 1
    store = RolloutStore.open(run / "store", create=False)
    assert store.sql("SELECT count(DISTINCT rollout_id) AS n FROM rollouts")["n"][0].as_py() == 48
    assert store.count() == 48


@pytest.mark.slow
def test_two_ranks_step_like_one_process_on_the_global_batch(ref, tmp_path):
    # One round only: later rounds would sample from slightly different weights.
    one = tmp_path / "one"
    p = _launch(["train", str(_config(one, steps=ROUND))], ranks=1)
    assert p.returncode == 0, p.stderr[-4000:]
    two_usage, one_usage = _usage(ref / "run"), _usage(one / "run")
    assert {s: two_usage[s] for s in range(ROUND)} == one_usage  # the same global selections
    a = load_file(str(_ckpt(one / "run", ROUND)))
    b = load_file(str(_ckpt(ref / "run", ROUND)))
    moved = load_file(str(_ckpt(ref / "run", STEPS)))
    # Summed gradients of the two shards == the whole batch's, up to summation order. AdamW
    # is scale-invariant, so the gradient norm is what exposes averaging instead of summing
    # (or normalising by a rank's own token count).
    # The logged metrics are the global batch's too (reduced over ranks, not rank 0's share).
    keys = ("grad_norm", "loss", "entropy", "staleness", "tokens", "sequences", "reward")
    one_m, two_m = ([[r[k] for k in keys] for r in _train_records(d / "run")] for d in (one, ref))
    for step, (x, y) in enumerate(zip(one_m, two_m[:ROUND]), 1):
        assert y == pytest.approx(x, rel=1e-4), f"step {step}: {keys}"
    assert min(x[0] for x in one_m) > 0
    # AdamW divides by sqrt(v) + eps: coordinates with a ~1e-8 gradient (rare embedding rows)
    # turn rounding differences into ~1e-6 differences of the update; allow 1% of one step (lr).
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=name)
    assert max(float((moved[k] - b[k]).abs().max()) for k in b) > 1e-4  # a real difference


@pytest.mark.slow
def test_killed_rank_resumes_with_two_ranks_to_the_same_bits(ref, tmp_path):
    crash = tmp_path / "crash"
    cfg = _config(crash)
    p = _launch(["train", str(cfg)], ranks=2, fault="step:4")  # rank 1 dies after step 4
    assert p.returncode != 0
    assert "SIGKILL" in p.stderr or "-9" in p.stderr, p.stderr[-4000:]
    run = crash / "run"
    assert sorted(x.name for x in (run / "checkpoints").iterdir())[-1] == f"step-{ROUND:09d}"

    # A different number of ranks would split the draws differently: refused, nothing run.
    p = _launch(["resume", str(run)], ranks=1)
    assert p.returncode != 0 and "written by 2 learner rank(s)" in p.stderr, p.stderr[-4000:]
    assert "--nproc-per-node 2" in p.stderr

    p = _launch(["resume", str(run)], ranks=2, trace=crash / "trace")
    assert p.returncode == 0, p.stderr[-4000:]
    # gloo sums two ranks' gradients with one addition per element, so a resumed run is
    # bit-for-bit the uninterrupted one, on every rank.
    assert _ckpt(run, STEPS).read_bytes() == _ckpt(ref / "run", STEPS).read_bytes()
    resumed, uninterrupted = _trace(crash / "trace"), _trace(ref / "trace")
    for rank in (0, 1):
        assert resumed[rank] == uninterrupted[rank][ROUND:]
    assert _usage(run, distinct=True) == _usage(ref / "run")
    ids = [
        RolloutStore.open(d / "run" / "store")
        .sql("SELECT rollout_id FROM rollouts ORDER BY 1")["rollout_id"]
        .to_pylist()
        for d in (ref, crash)
    ]
    assert ids[0] == ids[1] and len(set(ids[1])) == len(ids[1])


# -- FSDP ([run] fsdp = true): the same loop with the learner sharded by fully_shard ----------
# The clip is below the first steps' grad norms (~3e-3, 1e-3): the sharded norm must be the
# global one, or the clipped update differs from DDP's.
FSDP_SETS = ["--set", "run.fsdp=true", "--set", "optim.grad_clip=0.001"]


@pytest.fixture(scope="module")
def fsdp_ref(tmp_path_factory) -> Path:
    """An uninterrupted 2-rank FSDP run (its folder holds run/ and trace/)."""
    folder = tmp_path_factory.mktemp("fsdp") / "ref"
    p = _launch(["train", str(_config(folder)), *FSDP_SETS], ranks=2, trace=folder / "trace")
    assert p.returncode == 0, p.stderr[-4000:]
    return folder


@pytest.mark.slow
def test_fsdp_steps_like_ddp_and_only_rank_0_writes(fsdp_ref, tmp_path):
    # DDP with the same clip, over the first round (the FSDP run's later rounds are checked
    # against DDP through its first, and against themselves on resume).
    ddp = tmp_path / "ddp"
    sets = ["--set", "optim.grad_clip=0.001"]
    p = _launch(["train", str(_config(ddp, steps=ROUND)), *sets], ranks=2, trace=ddp / "trace")
    assert p.returncode == 0, p.stderr[-4000:]
    run = fsdp_ref / "run"
    fsdp_m, ddp_m = _train_records(run), _train_records(ddp / "run")
    assert fsdp_m[0]["grad_norm"] > 2e-3 and ddp_m[0]["grad_norm"] > 2e-3  # clipping engaged
    for x, y in zip(fsdp_m, ddp_m):  # the global norm and loss, not a shard's
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), x["step"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-9), x["step"]
    # The same selections, split the same way between the ranks.
    fsdp_t, ddp_t = _trace(fsdp_ref / "trace"), _trace(ddp / "trace")
    for rank in (0, 1):
        got = [r["rollout_ids"] for r in fsdp_t[rank][:ROUND]]
        assert got == [r["rollout_ids"] for r in ddp_t[rank]]
    assert {s: _usage(run)[s] for s in range(ROUND)} == _usage(ddp / "run")
    # Sums of the same two per-rank gradients (unclipped, the weights come out bit-identical);
    # the sharded norm adds its squares in another order, so the clip factor differs in the
    # last bits, which AdamW's 1/(sqrt(v) + eps) turns into up to ~4e-6 on rare embedding rows
    # (see the DDP test above): allow 1% of one step (lr).
    a, b = load_file(str(_ckpt(run, ROUND))), load_file(str(_ckpt(ddp / "run", ROUND)))
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
    init = load_file(str(next((run / "model-init").glob("*.safetensors"))))
    assert max(float((a[k] - init[k]).abs().max()) for k in a) > 1e-4  # the weights moved

    # Rank 0 alone gathered and wrote: one record per step, full checkpoints that hold the
    # weights every rank traced (each rank digests the gathered weights), one event file.
    assert [r["step"] for r in fsdp_m] == list(range(1, STEPS + 1))
    assert all(r["sequences"] == 8 and r["learner_ranks"] == 2 for r in fsdp_m)
    assert len(list((run / "tb").iterdir())) == 1
    for step in (ROUND, STEPS):
        assert _digest(_ckpt(run, step)) == fsdp_t[1][step - 1]["weights_sha256"]
    assert (run / "weights" / "LATEST").exists()
    assert RolloutStore.open(run / "store", create=False).count() == 48


@pytest.mark.slow
def test_fsdp_killed_rank_resumes_to_the_same_bits(fsdp_ref, tmp_path):
    crash = tmp_path / "crash"
    p = _launch(["train", str(_config(crash)), *FSDP_SETS], ranks=2, fault="step:4")
    assert p.returncode != 0
    run = crash / "run"
    assert sorted(x.name for x in (run / "checkpoints").iterdir())[-1] == f"step-{ROUND:09d}"
    p = _launch(["resume", str(run)], ranks=2, trace=crash / "trace")
    assert p.returncode == 0, p.stderr[-4000:]
    # Every rank re-shards the full checkpoint (weights and AdamW moments); gloo sums two
    # gradients with one addition per element, so the resumed run is the uninterrupted one.
    assert _ckpt(run, STEPS).read_bytes() == _ckpt(fsdp_ref / "run", STEPS).read_bytes()
    resumed, uninterrupted = _trace(crash / "trace"), _trace(fsdp_ref / "trace")
    for rank in (0, 1):
        assert resumed[rank] == uninterrupted[rank][ROUND:]
    assert _usage(run, distinct=True) == _usage(fsdp_ref / "run")


def test_fsdp_without_torchrun_is_an_error(tmp_path):
    p = _launch(["train", str(_config(tmp_path / "one")), "--set", "run.fsdp=true"], ranks=1)
    assert p.returncode != 0 and "run.fsdp = true" in p.stderr and "torchrun" in p.stderr
    assert not (tmp_path / "one" / "run" / "checkpoints").exists()
