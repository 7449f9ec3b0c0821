"""tools/seed_results.py: the report of a config over seeds — eval mean +- sd per step, each
eval's standard error, entropy, mu from the runs' own timings — on per-seed metrics written
here, and a refusal when nothing finished."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import seed_results as sr  # noqa: E402


def _write(run: Path, evals: list[tuple[int, float, float | None]], gen_s: float, train_s: float):
    run.mkdir(parents=True)
    recs = []
    for step, reward, se in evals:
        rec = {"kind": "eval", "step": step, "reward": reward}
        if se is not None:
            rec["reward_stderr"] = se
        recs.append(rec)
    # Two rounds of 64 rollouts; four learner steps of 32 uses each.
    recs += [{"kind": "generate", "step": 0, "rollouts": 64, "seconds": gen_s / 2}] * 2
    recs += [
        {"kind": "train", "step": i + 1, "sequences": 32.0, "seconds": train_s / 4,
         "entropy": 2.0 - 0.1 * i}
        for i in range(4)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_report_means_sds_stderr_and_mu(tmp_path):
    _write(tmp_path / "seed-0", [(0, 0.10, 0.02), (10, 0.30, 0.03)], gen_s=64.0, train_s=8.0)
    _write(tmp_path / "seed-1", [(0, 0.20, None), (10, 0.50, None)], gen_s=32.0, train_s=8.0)
    _write(tmp_path / "seed-2", [(0, 0.15, None)], gen_s=64.0, train_s=16.0)  # stopped early
    text = sr.report(tmp_path)
    eval_table = text.split("\n\n")[1]  # the per-step table; the per-seed one follows
    rows = {line.split("|")[1].strip(): line for line in eval_table.splitlines()}
    mean0, sd0 = statistics.mean([0.1, 0.2, 0.15]), statistics.stdev([0.1, 0.2, 0.15])
    assert f"{mean0:.3f} +- {sd0:.3f}" in rows["0"]
    assert "0.100 +- 0.020" in rows["0"]  # seed 0's own standard error
    assert f"{statistics.mean([0.3, 0.5]):.3f} +- {statistics.stdev([0.3, 0.5]):.3f}" in rows["10"]
    assert rows["10"].count("| - |") == 1  # seed 2 has no step-10 eval
    # mu = (gen s / rollout) / (learner s / use): seed 0 (64/128) / (8/128) = 8; seed 2: 4.
    seed_rows = [line for line in text.splitlines() if line.startswith("| 0 | 2.000")]
    assert seed_rows and seed_rows[0].rstrip().endswith("| 8.00 |")
    assert any(line.startswith("| 2 |") and line.rstrip().endswith("| 4.00 |")
               for line in text.splitlines())  # fmt: skip
    assert (tmp_path / "results.md").read_text() == text
    assert (tmp_path / "results.png").stat().st_size > 0


def test_report_refuses_a_folder_without_runs(tmp_path):
    with pytest.raises(SystemExit, match="no finished runs"):
        sr.report(tmp_path)
