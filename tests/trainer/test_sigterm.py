"""SIGTERM (``kill``, a scheduler stopping a job) stops a command as Ctrl-C does: its cleanup
runs and it exits 143. Before, the trainer died at once and its vLLM engine processes (re-parented
to init, ~2.5 GB each on a real model) kept running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, require_vllm

from rolloutstore.cli.base import Parser, run_main
from trainer.models.tiny import make_tiny_model


def _parser_running(func):
    def build():
        p = Parser(prog="t")
        p.set_defaults(func=func)
        return p

    return build


@pytest.fixture
def default_sigterm():
    """SIGTERM at its default disposition, as in a fresh CLI process (earlier tests in this
    process, e.g. a Ray driver, may have set a handler of their own)."""
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, old)


def test_sigterm_runs_the_commands_cleanup_and_exits_143(capsys, default_sigterm):
    cleaned = []

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises at the next bytecode, long before this ends
            raise AssertionError("SIGTERM did not stop the command")
        finally:
            cleaned.append(True)

    assert run_main(_parser_running(command), []) == 143
    assert cleaned == [True]
    assert capsys.readouterr().err.strip() == "error: terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored after the command


def test_a_handler_the_process_set_is_kept():
    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:

        def command(args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

        assert run_main(_parser_running(command), []) == 0
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


RUN_TOML = """
[model]
path = "{model}"
device = "cpu"
[task]
name = "arith"
options = {{ max_operands = 2, max_digits = 1 }}
[generation]
backend = "vllm"
group_size = 4
max_tokens = 6
prompts_per_round = 4
[run]
dir = "{run}"
steps = 10000
updates_per_round = 1
batch_size = 8
checkpoint_every = 10000
threads = 1
[eval]
prompts = 0
"""


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited


def test_sigterm_stops_the_vllm_engine_with_the_trainer(tmp_path):
    require_vllm()
    model = make_tiny_model(tmp_path / "model", num_layers=1, num_texts=300)
    run = tmp_path / "run"
    (tmp_path / "run.toml").write_text(RUN_TOML.format(model=model, run=run))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "ERROR"}
    p = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", str(tmp_path / "run.toml"), "-q"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    engine: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and '"train"' in metrics.read_text()):
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached a learner step"
            time.sleep(0.5)
        engine = _children(p.pid)
        assert engine, "vLLM runs its engine in child processes"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=180)
        assert p.returncode == 143, err[-3000:]
        assert err.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
        deadline = time.monotonic() + 60
        while any(map(_alive, engine)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in engine if _alive(pid)], "engine processes outlived the trainer"
    finally:
        for pid in [p.pid, *engine]:  # whatever the outcome, leave no process behind
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        p.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any(r["kind"] == "train" for r in records)  # what it wrote before the stop is kept
