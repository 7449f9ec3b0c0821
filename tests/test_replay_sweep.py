"""tools/replay_sweep.py and its modules replay_sweep_grid.py and replay_sweep_report.py: the
grid's configs, the per-cell cache and resume, the bootstrap and report math on synthetic
per-seed results, and one tiny real cell end to end."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import replay_sweep as rs  # noqa: E402  (the runner and the CLI)
from tools import replay_sweep_grid as grid  # noqa: E402  (cells, sizing, configs, cache)
from tools import replay_sweep_report as rep  # noqa: E402  (to-target numbers, bootstrap, report)
from tools.replay_common import load_base  # noqa: E402

BASE = load_base(ROOT / "examples" / "arith.toml")


# -- the grid -----------------------------------------------------------------------------------
def test_cells_map_to_updates_window_and_loss(tmp_path):
    sz = grid.Sizing()
    assert len(grid.GRID) == 19 and len({c.name for c in grid.GRID}) == 19
    assert grid.parse_cell("onpolicy") == grid.ONPOLICY and grid.ONPOLICY.onpolicy
    for cell in grid.GRID:
        assert grid.parse_cell(cell.name) == cell
    on = grid.build_config(BASE, grid.ONPOLICY, 3, sz, tmp_path)
    assert on.task.name == "carry_add" and on.generation.backend == "hf"
    assert (on.run.updates_per_round, on.run.batch_size, on.replay.window) == (1, 64, 64)
    assert on.run.warm_start_steps == 0 and on.model.path == str(tmp_path / "warm")
    assert (on.run.seed, on.replay.seed, on.optim.seed) == (3, 3, 3)
    assert on.replay.max_uses is None and on.replay.max_staleness is None
    y16 = grid.build_config(BASE, grid.parse_cell("ppo-y16-n16"), 3, sz, tmp_path)
    assert (y16.run.updates_per_round, y16.replay.window) == (16, 1024)
    ep = grid.build_config(BASE, grid.parse_cell("ppo-ep4-y8-n4"), 3, sz, tmp_path)
    assert (ep.run.updates_per_round, ep.optim.ppo_epochs, ep.replay.window) == (2, 4, 256)
    m2po = grid.build_config(BASE, grid.parse_cell("m2po-y8-n4"), 3, sz, tmp_path)
    assert m2po.loss.loss_type == "m2po"
    # Equal compute at mu_budget: rounds x R x (mu + y) ~ budget_rounds x R x (mu + 1).
    for cell in grid.GRID:
        r = sz.rounds(cell)
        assert r * (sz.mu_budget + cell.y) >= sz.budget_rounds * (sz.mu_budget + 1) - 1e-9
        assert (r - 1) * (sz.mu_budget + cell.y) < sz.budget_rounds * (sz.mu_budget + 1)
    with pytest.raises(ValueError, match="not a cell name"):
        grid.parse_cell("sgd-y2-n1")
    # The overrides round-trip through the config format.
    assert type(on).from_dict(on.to_dict()) == on


def test_hash_follows_the_sizing_not_the_folders(tmp_path):
    sz = grid.Sizing()
    cfg = grid.build_config(BASE, grid.ONPOLICY, 0, sz, tmp_path / "a")
    same = grid.build_config(BASE, grid.ONPOLICY, 0, sz, tmp_path / "b")
    assert grid.config_hash(cfg, sz) == grid.config_hash(same, sz)
    other = grid.Sizing(budget_rounds=sz.budget_rounds + 1)
    assert grid.config_hash(grid.build_config(BASE, grid.ONPOLICY, 0, other, tmp_path), other) != (
        grid.config_hash(cfg, sz)
    )
    more = grid.Sizing(passk_samples=4)
    assert grid.config_hash(cfg, more) != grid.config_hash(cfg, sz)
    assert grid.config_hash(grid.build_config(BASE, grid.ONPOLICY, 1, sz, tmp_path), sz) != (
        grid.config_hash(cfg, sz)
    )


def test_select_cells_names_globs_and_all(tmp_path):
    cache = grid.Cache(tmp_path / "c.json")
    pick = rs.select_cells(["onpolicy", "ppo-y1-n1", "ppo-y*-n4"], cache, None, 0.5)
    assert [c.name for c in pick] == ["ppo-y1-n1"] + [f"ppo-y{y}-n4" for y in (1, 2, 4, 8, 16)]
    assert rs.select_cells(["all"], cache, None, 0.5) == grid.GRID
    with pytest.raises(SystemExit):
        rs.select_cells(["nothing-*"], cache, None, 0.5)


def test_carry_task_worked_answers_and_reward():
    from tools.carry_task import CarryAddTask, worked_answer

    assert worked_answer(478, 356) == "8+6=14 7+5+1=13 4+3+1=8 so 834"
    assert worked_answer(56, 274) == "6+4=10 5+7+1=13 0+2+1=3 so 330"
    assert worked_answer(277, 10) == "7+0=7 7+1=8 2+0=2 so 287"
    task = CarryAddTask()
    prompts = task.make_prompts(50, seed=1)
    assert prompts == task.make_prompts(50, seed=1)
    assert {p.prompt_text for p in prompts}.isdisjoint(
        p.prompt_text for p in task.make_eval_prompts(50, seed=1)
    )
    for p in prompts:
        a, b = map(int, p.meta["expression"].split("+"))
        assert 10 <= a < 1000 and 10 <= b < 1000 and p.meta["value"] == a + b
        assert task.reward(p, " " + p.answer).reward == 1.0
        assert task.reward(p, " " + p.answer.rsplit(" ", 1)[0]).reward == 0.0  # cut short
    cfg = grid.build_config(BASE, grid.ONPOLICY, 0, grid.Sizing(), Path("x"))
    assert cfg.task.build().name == "carry_add"


# -- cache and resume ---------------------------------------------------------------------------
def test_cache_skips_finished_runs_and_survives_a_reload(tmp_path):
    sz = grid.Sizing()
    cells = [grid.ONPOLICY, grid.parse_cell("ppo-y4-n4")]
    cache = grid.Cache(tmp_path / "cache.json")
    jobs = rs.make_jobs(BASE, cells, [0, 1], sz, tmp_path, cache)
    assert [(j["cell"], j["seed"]) for j in jobs] == [
        ("ppo-y1-n1", 0), ("ppo-y4-n4", 0), ("ppo-y1-n1", 1), ("ppo-y4-n4", 1),
    ]  # fmt: skip
    cache.begin_session(["--jobs", "1"], 1)
    for j in jobs[:3]:  # the fourth run "was killed": nothing cached for it
        cache.put(grid.parse_cell(j["cell"]), j["seed"], _record(j["cell"], j["seed"], j["hash"]))
    again = grid.Cache(tmp_path / "cache.json")
    left = rs.make_jobs(BASE, cells, [0, 1], sz, tmp_path, again)
    assert [(j["cell"], j["seed"]) for j in left] == [("ppo-y4-n4", 1)]
    assert again.sessions[0]["runs"] == 3 and again.sessions[0]["argv"] == ["--jobs", "1"]
    # Another sizing is another configuration: nothing cached counts.
    other = grid.Sizing(budget_rounds=7)
    assert len(rs.make_jobs(BASE, cells, [0, 1], other, tmp_path, again)) == 4
    assert json.loads((tmp_path / "cache.json").read_text())["schema"] == grid.SCHEMA


def test_a_resumed_cache_refuses_a_different_warm_start(tmp_path):
    """A cache committed in one checkout is resumed in another whose warm start is rebuilt: the
    same spec must give the same held-out figures, else the cached runs started elsewhere."""
    spec = {"steps": 250, "lr": 0.001, "seed": 0}
    warm = {"spec": spec, "seconds": 14.0, "pass1": 0.2978, "pass4": math.nan,
            "heldout_entropy": 0.2094, "heldout_tokens": 27.29}  # fmt: skip
    cache = grid.Cache(tmp_path / "cache.json")
    cache.adopt_warm(warm)
    cache.save()
    again = grid.Cache(tmp_path / "cache.json")
    again.adopt_warm({**warm, "seconds": 70.0})  # rebuilt: slower, the same model (NaN = NaN)
    assert again.warm["seconds"] == 70.0
    with pytest.raises(SystemExit, match=r"pass1 0\.2978 -> 0\.31.*new --cache"):
        again.adopt_warm({**warm, "pass1": 0.31})
    assert again.warm["pass1"] == 0.2978  # refused: the cached warm start kept
    # Another spec is another start (its runs hash differently): taken.
    again.adopt_warm({**warm, "spec": {**spec, "steps": 100}, "pass1": 0.1})
    assert again.warm["pass1"] == 0.1


def test_a_cache_knows_its_warm_start_by_its_weights(tmp_path):
    """With a weights hash, that is the identity: the same weights with other held-out figures
    (measured on another machine) are the same start; other weights are refused."""
    spec = {"steps": 250, "lr": 0.001, "seed": 0}
    warm = {"spec": spec, "weights": "cb955946e65dc512", "pass1": 0.2666, "pass4": 0.547}
    cache = grid.Cache(tmp_path / "cache.json")
    cache.adopt_warm(warm)
    cache.save()
    again = grid.Cache(tmp_path / "cache.json")
    again.adopt_warm({**warm, "pass1": 0.2461})  # the tracked start, scored on another CPU
    assert again.warm["pass1"] == 0.2461
    with pytest.raises(SystemExit, match=r"weights 0123456789abcdef\) is not.*cb955946e65dc512"):
        again.adopt_warm({**warm, "weights": "0123456789abcdef"})
    assert again.warm["weights"] == "cb955946e65dc512"


def test_the_tracked_warm_start_is_the_default_sweeps_and_is_copied_not_rebuilt(
    tmp_path, monkeypatch
):
    """docs/data/replay_sweep_warm is the start of the default sizing's runs on every machine:
    ensure_warm copies it (no training), checks its weights against its warm.json, and refuses
    a folder whose weights were changed."""
    import trainer.run.setup

    kept = json.loads((grid.WARM_KEPT / "warm.json").read_text())
    assert kept["weights"] == grid.weights_digest(grid.WARM_KEPT)
    assert {"cpu", "capability", "torch"} <= set(kept["machine"])

    def no_training(*a, **k):
        raise AssertionError("the warm start was rebuilt, not copied")

    monkeypatch.setattr(trainer.run.setup, "warm_start", no_training)
    info = rs.ensure_warm(BASE, grid.Sizing(), tmp_path / "runs")
    assert info == kept  # the default sizing's spec is the tracked one's
    got = tmp_path / "runs" / "warm"
    assert (got / "model.safetensors").read_bytes() == (
        grid.WARM_KEPT / "model.safetensors"
    ).read_bytes()
    assert rs.ensure_warm(BASE, grid.Sizing(), tmp_path / "runs") == kept  # already there
    # A tracked folder whose weights are not those its warm.json names is refused.
    bad = tmp_path / "bad"
    shutil.copytree(grid.WARM_KEPT, bad)
    blob = bytearray((bad / "model.safetensors").read_bytes())
    blob[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(SystemExit, match="not the ones its warm.json names"):
        rs.ensure_warm(BASE, grid.Sizing(), tmp_path / "other", kept=bad)
    assert not (tmp_path / "other" / "warm").exists()


# -- per-run numbers ----------------------------------------------------------------------------
def test_summarise_run_reads_the_loop_metrics():
    recs = [{"kind": "eval", "step": 0, "reward": 0.2, "generated_tokens": 0}]
    for s in range(1, 9):  # y = 2: a round of 64 rollouts every 2 steps
        rnd = (s + 1) // 2
        recs.append(
            {
                "kind": "train", "step": s, "entropy": 1.0 / s, "generated_tokens": 1600 * rnd,
                "generated_rollouts": 64 * rnd, "gen_seconds": 0.5 * rnd,
                "train_seconds": 0.25 * s, "approx_kl": 0.01 * s, "ess_frac": 1.0,
                # staleness 0 on a round's first step, then 32 rows of 0 and 32 of 1
                "staleness_hist": {"0": 64} if s % 2 else {"0": 32, "1": 32},
            }
        )  # fmt: skip
        if s % 4 == 0:
            recs.append({**recs[-1], "kind": "eval", "reward": 0.2 + 0.05 * s})
    out = rs.summarise_run(recs, grid.parse_cell("ppo-y2-n4"), 64)
    assert out["curve"][0] == [0, 0, 0, 0, 0.2]
    assert out["curve"][1] == [4, 3200, 128, 256, pytest.approx(0.4)]
    assert (out["steps"], out["tokens"], out["rollouts"], out["uses"]) == (8, 6400, 256, 512)
    # mu = (2.0 s / 256 rollouts) / (2.0 s / 512 passes) = 2
    assert out["mu"] == pytest.approx(2.0)
    assert out["train_entropy"] == pytest.approx(sum(1.0 / s for s in range(4, 9)) / 5)
    assert out["final_reward"] == pytest.approx(0.6)
    # 512 drawn rows, 128 of them one version stale: mean 1/4, variance 1/4 - 1/16.
    assert out["staleness_mean"] == pytest.approx(0.25)
    assert out["staleness_var"] == pytest.approx(0.25 - 0.0625)
    assert out["approx_kl_mean"] == pytest.approx(0.045) and out["ess_frac_mean"] == 1.0
    # Records of a loop that logs none of them (older runs): NaN, not an error.
    bare = [{k: v for k, v in r.items() if k not in ("staleness_hist", "approx_kl")} for r in recs]
    out = rs.summarise_run(bare, grid.parse_cell("ppo-y2-n4"), 64)
    assert math.isnan(out["staleness_mean"]) and math.isnan(out["approx_kl_mean"])


def test_pass_at_k_is_the_unbiased_estimator():
    assert rs.pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert rs.pass_at_k(8, 2, 4) == pytest.approx(1 - math.comb(6, 4) / math.comb(8, 4))
    assert rs.pass_at_k(8, 0, 4) == 0.0 and rs.pass_at_k(8, 5, 4) == 1.0


def test_target_and_compute_at_a_mu():
    # Smoothed (3-eval moving average): 0.2, 0.3, 0.467, 0.55: 0.45 first at the third eval,
    # though the raw 0.5 of one eval alone would not count.
    assert rep.smoothed([0.1, 0.3, 0.5, 0.6]) == pytest.approx([0.2, 0.3, 1.4 / 3, 0.55])
    rec = _record("ppo-y4-n4", 0, "h", curve=[[0, 0, 0, 0, 0.1], [8, 3000, 128, 512, 0.3],
                                             [16, 6000, 256, 1024, 0.5],
                                             [24, 9000, 384, 1536, 0.6]])  # fmt: skip
    assert rep.hit([[0, 0, 0, 0, 0.1], [8, 3000, 128, 512, 0.6], [9, 0, 0, 0, 0.1]], 0.5) is None
    # The start is not smoothed: its average with the first trained eval (0.3) would meet 0.3
    # at zero compute; the target is reached at the first trained eval (smoothed (0.2 + 0.4 +
    # 0.5) / 3), and a start that is already above the target counts at zero.
    start = [[0, 0, 0, 0, 0.2], [8, 3000, 128, 512, 0.4], [16, 6000, 256, 1024, 0.5]]
    assert rep.hit(start, 0.3) == start[1]
    assert rep.hit([[0, 0, 0, 0, 0.35], *start[1:]], 0.3) == [0, 0, 0, 0, 0.35]
    m = rep.run_metrics(rec, 0.45, {"measured": 1.0, "paper": 5.3})
    assert m["tokens_to_target"] == 6000
    assert m["compute_to_target@measured"] == 1024 + 256
    assert m["compute_to_target@paper"] == pytest.approx(1024 + 5.3 * 256)
    assert math.isnan(rep.run_metrics(rec, 0.9, {"measured": 1.0})["compute_to_target@measured"])


# -- statistics ---------------------------------------------------------------------------------
def test_measured_mu_leaves_out_starved_runs():
    """mu is a ratio of wall-clock phases: a run starved of CPU (cpu_s well under wall_s)
    stretches them unevenly, so the median is over the runs that had a core, when >= 3 did."""

    def run(mu, cpu_share):
        return {"mu": mu, "wall_s": 100.0, "cpu_s": 100.0 * cpu_share}

    cell = grid.ONPOLICY
    quiet = {0: run(1.0, 0.95), 1: run(1.2, 0.9), 2: run(1.1, 0.85)}
    busy = {3: run(3.0, 0.4), 4: run(4.0, 0.5), 5: run(2.5, 0.3), 6: run(float("nan"), 1.0)}
    assert rep.mu_runs({cell: {**quiet, **busy}}) == (pytest.approx(1.1), 3, 6)
    # Fewer than 3 unstarved runs: every run counts (records without cpu_s count as starved).
    two = {0: run(1.0, 0.95), 1: run(1.2, 0.9), 3: run(3.0, 0.4), 4: {"mu": 4.0, "wall_s": 1.0}}
    assert rep.mu_runs({cell: two}) == (pytest.approx(2.1), 4, 4)
    assert rep.measured_mu({cell: two}) == pytest.approx(2.1)


def test_bootstrap_mean_interval():
    mean, lo, hi = rep.bootstrap_mean([1.0, 2.0, 3.0, 4.0, float("nan")], n_boot=4000)
    assert mean == 2.5 and 1.0 <= lo < mean < hi <= 4.0
    assert rep.bootstrap_mean([5.0, 5.0, 5.0]) == (5.0, 5.0, 5.0)
    one = rep.bootstrap_mean([2.0])
    assert one[0] == 2.0 and math.isnan(one[1]) and math.isnan(rep.bootstrap_mean([])[0])


def test_saving_is_paired_by_seed():
    base = {0: 100.0, 1: 200.0, 2: 300.0, 3: 400.0}
    # 40% cheaper on every seed: paired, the interval collapses onto the point.
    s = rep.saving(base, {k: 0.6 * v for k, v in base.items()}, n_boot=2000)
    assert s["paired"] and s["n"] == 4
    assert s["point"] == pytest.approx(0.4) and s["lo"] == pytest.approx(0.4)
    assert s["hi"] == pytest.approx(0.4)
    # Unpaired, the spread between seeds widens it.
    shuffled = {10 + k: 0.6 * v for k, v in base.items()}
    u = rep.saving(base, shuffled, n_boot=2000)
    assert not u["paired"] and u["point"] == pytest.approx(0.4) and u["lo"] < 0.3 < 0.5 < u["hi"]
    # Seeds that did not reach the target (NaN) drop out of the pairs.
    p = rep.saving(base, {0: 60.0, 1: 120.0, 2: float("nan"), 3: 240.0}, n_boot=500)
    assert p["n"] == 3 and p["point"] == pytest.approx(0.4)
    assert math.isnan(rep.saving({0: 1.0}, {0: 1.0})["point"])
    # On-policy at the target from the start (zero compute): no finite saving.
    z = rep.saving({0: 0.0, 1: 0.0}, {0: 5.0, 1: 0.0}, n_boot=200)
    assert z["point"] == -math.inf and "-inf" in rep.fmt_pct(z)
    assert rep.saving({0: 0.0, 1: 0.0}, {0: 0.0, 1: 0.0}, n_boot=200)["point"] == 0.0


def test_report_tables_best_cell_and_saving(tmp_path):
    cache = grid.Cache(tmp_path / "cache.json")
    cache.warm = {"pass1": 0.2, "pass4": 0.4, "heldout_entropy": 0.3, "heldout_tokens": 27.0,
                  "seconds": 5.0, "spec": {"steps": 250}}  # fmt: skip
    inside = str(Path(rep.__file__).resolve().parents[1] / "docs" / "data" / "c.json")
    cache.sessions = [{"argv": ["--cache", inside, "--out", "/elsewhere/r.md"], "jobs": 2,
                       "seconds": 600.0, "runs": 12}]  # fmt: skip
    # on-policy hits 0.5 at uses 1000 / rollouts 1000; y4-n4 at uses 1200 / rollouts 300
    # (saves 40% at mu = 1: 2000 -> 1500... and more at mu = 5.3); y16-n4 never gets there.
    shapes = {
        "ppo-y1-n1": (1000, 1000),
        "ppo-y4-n4": (1200, 300),
        "ppo-y16-n4": None,
    }
    hashes = {}
    for name, hitpt in shapes.items():
        for seed in range(4):
            jitter = 1 + 0.05 * seed
            if hitpt:  # smoothed: 0.25, 0.37, 0.5, 0.6: the target at the third eval
                uses, rollouts = hitpt[0] * jitter, hitpt[1] * jitter
                curve = [
                    [0, 0, 0, 0, 0.2],
                    [1, 10, 1, 1, 0.3],
                    [2, rollouts * 25, rollouts, uses, 0.6],
                    [3, 9e4, 4e3, 9e3, 0.6],
                ]
            else:
                curve = [[0, 0, 0, 0, 0.2], [1, 5000, 200, 3200, 0.3]]
            rec = _record(name, seed, f"h-{name}-{seed}", curve=curve, mu=1.0)
            if seed < 2:  # runs from before machines were recorded have none
                rec["machine"] = {"cpu": "CPU X", "capability": "AVX2", "cores": 2, "torch": "2.9"}
            cache.put(grid.parse_cell(name), seed, rec)
            hashes[grid.Cache.key(grid.parse_cell(name), seed)] = rec["hash"]
    out = tmp_path / "results.md"
    out.write_text("# old report\n\nold text\n")
    block = rep.report(cache, hashes, grid.Sizing(), target=0.5, out=out, command="cmd",
                      n_boot=500)  # fmt: skip
    assert "| ppo-y1-n1 (on-policy) |" in block and "| ppo-y16-n4 |" in block
    # Paths inside the checkout are quoted relative to it, others as they were given.
    assert "`python tools/replay_sweep.py --cache docs/data/c.json --out /elsewhere/r.md`" in block
    assert "0/4" in block  # y16 never reached the target
    assert "CPU X (AVX2, 2 cores, torch 2.9): 6 runs; not recorded: 6 runs." in block
    assert "best replay cell **ppo-y4-n4**" in block
    # mu = 1: (1200 + 300) / (1000 + 1000) -> 25% saved; mu = 5.3: (1200 + 1590) / 6300.
    assert "saving 25% [25%, 25%] (paired, 4 seeds)" in block
    assert f"saving {100 * (1 - 2790 / 6300):.0f}%" in block
    assert "| 0.50 | 4/4 | ppo-y4-n4: 25% [25%, 25%] (paired, 4 seeds) |" in block
    text = out.read_text()
    assert text.index(rep.SWEEP_BEGIN) < text.index(rep.SWEEP_END) < text.index("old text")
    assert (tmp_path / "results_sweep_panels.png").stat().st_size > 0
    assert (tmp_path / "results_sweep_curves.png").stat().st_size > 0
    # A second report replaces the block and keeps the hand-written text around it.
    out.write_text(text.replace("(to write from the tables above)", "my reading"))
    rep.report(cache, hashes, grid.Sizing(), target=0.5, out=out, command="cmd2", n_boot=100)
    text = out.read_text()
    assert "my reading" in text and "`cmd2`" in text and "`cmd`" not in text


def _record(cell, seed, digest, curve=None, mu=1.1):
    curve = curve or [[0, 0, 0, 0, 0.2], [4, 3000, 128, 256, 0.4]]
    last = curve[-1]
    return {
        "cell": cell, "seed": seed, "hash": digest, "curve": curve, "steps": last[0],
        "tokens": last[1], "rollouts": last[2], "uses": last[3], "gen_seconds": 1.0,
        "train_seconds": 1.0, "mu": mu, "first_reward": curve[0][4], "final_reward": last[4],
        "train_entropy": 0.3, "pass1": last[4], "pass4": min(1.0, 2 * last[4]),
        "heldout_entropy": 0.25, "heldout_tokens": 27.0, "wall_s": 60.0, "train_wall_s": 50.0,
    }  # fmt: skip


# -- one tiny real cell -------------------------------------------------------------------------
TINY = [
    "--budget-rounds", "2", "--evals", "2", "--eval-prompts", "4", "--passk-prompts", "2",
    "--passk-samples", "4", "--warm-steps", "2", "--prompts-per-round", "2", "--group-size",
    "4", "--batch-size", "8",
]  # fmt: skip


def test_one_tiny_cell_runs_caches_and_resumes(tmp_path, capsys, keep_torch_threads):
    args = ["--run-root", str(tmp_path), "--cells", "ppo-y2-n4", "--seeds", "0", *TINY]
    assert rs.main(args) == 0
    data = json.loads((tmp_path / "cache.json").read_text())
    rec = data["runs"]["ppo-y2-n4/s0"]
    # y = 2 with R = B = 8: 2 steps per round; equal compute at mu 5.3: ceil(2 x 6.3 / 7.3) = 2
    # rounds, an eval after each.
    assert (rec["steps"], rec["rollouts"], rec["uses"]) == (4, 16, 32)
    assert 0.0 <= rec["pass1"] <= rec["pass4"] <= 1.0 and rec["mu"] > 0
    assert [p[0] for p in rec["curve"]] == [0, 2, 4]
    assert data["warm"]["spec"]["steps"] == 2  # not the tracked start's spec: built here
    assert data["warm"]["weights"] == grid.weights_digest(tmp_path / "warm")
    import torch

    assert rec["machine"]["torch"] == data["sessions"][0]["machine"]["torch"] == torch.__version__
    run_dir = tmp_path / "ppo-y2-n4" / "s0"
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "run.json"]
    capsys.readouterr()
    assert rs.main(args) == 0  # everything cached: nothing runs
    assert "0 runs to do (1 cached)" in capsys.readouterr().out


def _stat(proc: Path) -> tuple[str, int] | None:
    """(state, parent pid) of the process whose /proc folder is ``proc``; None once it is gone."""
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    """The pool workers of process ``pid`` (spawned: ``multiprocessing.spawn`` in their argv)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        stat = _stat(proc)
        if stat is None or stat[1] != pid:
            continue
        with contextlib.suppress(OSError):
            if b"multiprocessing.spawn" in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
    return out


def _running(pid: int) -> bool:
    stat = _stat(Path(f"/proc/{pid}"))
    return stat is not None and stat[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the workers")
def test_sigterm_stops_the_sweep_and_its_pool_workers(tmp_path):
    """SIGTERM (kill, a scheduler's stop) during a --jobs 2 sweep: the sweep exits 143 at once,
    and neither pool worker runs on (before, they ran their runs to the end, unseen)."""
    args = ["--run-root", str(tmp_path), "--cells", "ppo-y2-n4", "--seeds", "0", "1"]
    cmd = [sys.executable, str(ROOT / "tools/replay_sweep.py"), *args, "--jobs", "2", *TINY]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while len(workers := _children(proc.pid)) < 2:  # after the warm start
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # inside their runs
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    try:
        assert proc.returncode == 143, err.decode()[-2000:]
        assert "stopped (SIGTERM)" in err.decode()
        deadline = time.monotonic() + 30
        while alive := [w for w in workers if _running(w)]:
            assert time.monotonic() < deadline, f"pool workers {alive} still running"
            time.sleep(0.2)
    finally:
        for w in workers:  # none is left behind, whatever failed
            with contextlib.suppress(OSError):
                os.kill(w, signal.SIGKILL)
