"""The replay sweep's tuned protocol and the paper's cells (issue #30): cell names, their
configs, the lr choice on tuning seeds only, the seed checks, the fresh-seed saving and the
compute-vs-lr table, on fake cache records (no training)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import replay_sweep as rs  # noqa: E402  (the runner and the CLI)
from tools import replay_sweep_grid as grid  # noqa: E402  (cells, sizing, configs, cache)
from tools import replay_sweep_report as rep  # noqa: E402  (saving, bootstrap)
from tools import replay_sweep_theory as theory  # noqa: E402  (item 5)
from tools import replay_sweep_tune as tune  # noqa: E402  (lr choice, tuned section)
from tools.replay_common import load_base  # noqa: E402

BASE = load_base(ROOT / "examples" / "arith.toml")
TARGET = 0.45  # the curves below: smoothed 0.25, 0.37, 0.5, 0.6: first reached at the third eval
TUNE, FRESH = [100, 101], [200, 201, 202, 203, 204]


def _curve(uses: float, rollouts: float) -> list[list[float]] | None:
    """An eval curve that first reaches TARGET (smoothed) at [uses, rollouts]."""
    return [[0, 0, 0, 0, 0.2], [1, 10, 1, 1, 0.3], [2, 25 * rollouts, rollouts, uses, 0.6],
            [3, 9e4, 4e3, 9e3, 0.6]]  # fmt: skip


NEVER = [[0, 0, 0, 0, 0.2], [1, 5000, 200, 3200, 0.3]]


def _record(cell: grid.Cell, seed: int, curve, mu: float = 1.0, digest: str = "h") -> dict:
    last = curve[-1]
    return {
        "cell": cell.name, "seed": seed, "hash": digest, "curve": curve, "steps": last[0],
        "tokens": last[1], "rollouts": last[2], "uses": last[3], "gen_seconds": 1.0,
        "train_seconds": 1.0, "mu": mu, "first_reward": curve[0][4], "final_reward": last[4],
        "train_entropy": 0.3, "pass1": last[4], "pass4": min(1.0, 2 * last[4]),
        "heldout_entropy": 0.25, "heldout_tokens": 27.0, "wall_s": 60.0, "train_wall_s": 50.0,
    }  # fmt: skip


# -- cells --------------------------------------------------------------------------------------
def test_cell_names_round_trip_and_the_paper_group():
    cells = grid.GRID + grid.PAPER_CELLS
    tuned = [c.at(lr) for c in cells for lr in (*tune.DEFAULT_LR_GRID, 3e-5, 1 / 3 * 1e-4)]
    for cell in cells + tuned:
        assert grid.parse_cell(cell.name) == cell
    assert len({c.name for c in cells + tuned}) == len(cells + tuned)
    # The first sweep's names are unchanged (its cache keys stay valid).
    assert grid.ONPOLICY.name == "ppo-y1-n1" and grid.parse_cell("ppo-ep4-y8-n4").epochs == 4
    assert grid.Cell("asymre", 4, 16, pos=50).name == "asymre-pos50-y4-n16"
    assert grid.Cell("ppo", 2, 4, pos=25, lr=2.5e-5).name == "ppo-pos25-y2-n4-lr2.5e-5"
    assert grid.Cell("ppo", 4, 16, cap=8, lr=1e-4).name == "ppo-y4-n16-s8-lr1e-4"
    assert grid.parse_cell("ppo-y4-n16-s0").cap == 0  # a cap of 0 is a cap, not "none"
    assert grid.parse_cell("ppo-y1-n1-lr0.0001") == grid.ONPOLICY.at(1e-4)
    # 2 losses x 2 deltas x 2 y x 2 N, and the staleness cap at y = 4.
    names = {c.name for c in grid.PAPER_CELLS}
    assert len(grid.PAPER_CELLS) == len(names) == 17 and "ppo-y4-n16-s8" in names
    assert {c.loss for c in grid.PAPER_CELLS} == {"asymre", "ppo"}
    assert {(c.pos, c.y, c.n) for c in grid.PAPER_CELLS if c.pos} == {
        (p, y, n) for p in (25, 50) for y in (2, 4) for n in (4, 16)
    }
    assert grid.ONPOLICY.at(5e-5).onpolicy and not grid.Cell("ppo", 1, 1, pos=25).onpolicy
    cache = grid.Cache(Path("/nonexistent/cache.json"))
    assert rs.select_cells(["paper"], cache, None, 0.5) == grid.PAPER_CELLS
    assert [c.name for c in rs.select_cells(["asymre-pos50-y4-*"], cache, None, 0.5)] == [
        "asymre-pos50-y4-n4", "asymre-pos50-y4-n16",
    ]  # fmt: skip
    assert sorted(tuned + cells)[0] == grid.Cell("asymre", 2, 4, pos=25)  # sorts; None first
    for bad in ("ppo-pos150-y2-n4", "ppo-y2-n4-lr0", "sgd-pos25-y2-n4", "ppo-y2-n4-s"):
        with pytest.raises(ValueError):
            grid.parse_cell(bad)


@pytest.mark.parametrize(
    "name, loss, pos, cap, lr",
    [
        ("asymre-pos50-y4-n16", "asymre", 50, None, None),
        ("asymre-pos25-y2-n4-lr2.5e-5", "asymre", 25, None, 2.5e-5),
        ("ppo-pos25-y2-n4", "ppo", 25, None, None),
        ("ppo-pos50-y4-n4-lr2e-4", "ppo", 50, None, 2e-4),
        ("ppo-y4-n16-s8", "ppo", 0, 8, None),
        ("ppo-y1-n1-lr5e-5", "ppo", 0, None, 5e-5),
    ],
)
def test_build_config_sets_the_cell_keys(tmp_path, name, loss, pos, cap, lr):
    sz = grid.Sizing()
    cell = grid.parse_cell(name)
    cfg = grid.build_config(BASE, cell, 7, sz, tmp_path)
    R = sz.rollouts_per_round
    assert cfg.optim.lr == (lr if lr is not None else sz.lr)
    assert cfg.loss.loss_type == loss
    if loss == "asymre":
        assert cfg.loss.asymre_delta == -0.1
    assert cfg.replay.window == cell.n * R
    assert cfg.replay.positive_fraction == pos / 100
    if pos:  # the freshest delta x N correct rows
        assert cfg.replay.positive_pool == pos * cell.n * R // 100
    assert cfg.replay.max_staleness == cap
    assert cfg.run.updates_per_round == cell.y * R // sz.batch_size
    assert cfg.run.steps == sz.rounds(cell) * cfg.run.updates_per_round
    # Validated by TrainConfig, and the overrides round-trip through the config format.
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
    # The lr suffix changes [optim] lr and nothing else: the same cell at the sizing's lr is
    # the same config under another name.
    at_default = grid.build_config(BASE, cell.at(sz.lr), 7, sz, tmp_path)
    base = grid.build_config(BASE, cell.base, 7, sz, tmp_path)
    assert grid.config_hash(at_default, sz) == grid.config_hash(base, sz)
    if lr is not None and lr != sz.lr:
        d, b = cfg.to_dict(), base.to_dict()
        assert d["optim"].pop("lr") != b["optim"].pop("lr")
        d["run"]["dir"] = b["run"]["dir"] = ""
        assert d == b


def test_the_first_sweep_cells_keep_the_plain_buffer(tmp_path):
    for cell in grid.GRID:
        cfg = grid.build_config(BASE, cell, 0, grid.Sizing(), tmp_path)
        assert cfg.replay.positive_fraction == 0.0 and cfg.replay.max_staleness is None
        assert cfg.optim.lr == grid.Sizing().lr


def test_plan_counts_the_paper_cells_and_both_phases(tmp_path, capsys):
    assert rs.main(["--plan", "--cells", "paper", "--run-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "85 runs, 85 to run" in out and "asymre-pos50-y4-n16 " in out
    args = ["--tune", "--cells", "paper", "--plan", "--run-root", str(tmp_path)]
    assert rs.main(args + ["--lr-grid", "5e-5", "1e-4", "2e-4"]) == 0
    out = capsys.readouterr().out
    # 17 paper cells + on-policy, x 3 lrs x 2 tuning seeds; then x 5 fresh seeds.
    assert "108 runs, 108 to run" in out and "ppo-y1-n1-lr2e-4 " in out
    assert "90 runs (18 cells x 5 fresh seeds)" in out


# -- seeds --------------------------------------------------------------------------------------
def test_overlapping_or_too_few_fresh_seeds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="share seed.*101"):
        tune.check_seeds([100, 101], [101, 200, 201, 202, 203])
    with pytest.raises(ValueError, match="needs >= 5"):
        tune.check_seeds([100, 101], [200, 201, 202, 203, 203])
    tune.check_seeds([100, 101], FRESH)
    tune.check_seeds([100, 101], [200], min_fresh=1)
    root = ["--run-root", str(tmp_path), "--tune-seeds", "1", "2"]
    for mode in (["--tune", "--plan"], ["--evaluate", "--plan"], ["--report"]):
        with pytest.raises(SystemExit) as exc:
            rs.main(root + mode + ["--fresh-seeds", "2", "3", "4", "5", "6"])
        assert "share seed(s) 2" in str(exc.value.code) and "\n" not in str(exc.value.code)
    with pytest.raises(SystemExit, match="needs >= 5"):
        rs.main(root + ["--tune", "--plan", "--fresh-seeds", "3"])


# -- the lr choice ------------------------------------------------------------------------------
CELL = grid.Cell("ppo", 4, 16, pos=50)
GRID_LR = [2.5e-5, 5e-5, 1e-4, 2e-4]


def _tuning(records, cell, lr, seeds, curves, mu=1.0, final=None):
    for s, curve in zip(seeds, curves):
        rec = _record(cell.at(lr), s, curve, mu)
        if final is not None:
            rec["final_reward"] = final
        records.setdefault(cell.at(lr), {})[s] = rec


def test_lr_choice_reads_the_tuning_seeds_only():
    records: dict = {}
    # Tuning seeds: 5e-5 is the cheapest to the target.
    for lr, uses in zip(GRID_LR, (900, 500, 700, 800)):
        _tuning(records, CELL, lr, TUNE, [_curve(uses, 100), _curve(uses + 10, 100)])
    # Fresh seeds: 2e-4 would be far cheaper, and 5e-5 never gets there.
    for lr in GRID_LR:
        curves = [_curve(50, 10) if lr == 2e-4 else NEVER if lr == 5e-5 else _curve(600, 100)]
        _tuning(records, CELL, lr, FRESH, curves * len(FRESH), mu=9.0)
    ch = tune.choose_lr(records, CELL, GRID_LR, TUNE, TARGET, mu=5.3)
    assert ch.lr == 5e-5 and ch.tuned == CELL.at(5e-5) and not ch.missing
    assert ch.chosen.reached == 2 and ch.chosen.compute(1.0) == pytest.approx(505 + 100)
    # The fake data does discriminate: read on the fresh seeds, the choice would be 2e-4.
    assert tune.choose_lr(records, CELL, GRID_LR, FRESH, TARGET, mu=5.3).lr == 2e-4
    # Without the fresh runs, the same choice.
    only = {c: {s: r for s, r in runs.items() if s in TUNE} for c, runs in records.items()}
    assert tune.choose_lr(only, CELL, GRID_LR, TUNE, TARGET, mu=5.3).lr == 5e-5
    # The report's section shows the same choice (and the measured mu of the tuning runs, not
    # the fresh runs' 9.0).
    lines = "\n".join(tune.tuned_section(records, lr_grid=GRID_LR, tune_seeds=TUNE,
                                         fresh_seeds=FRESH, target=TARGET, choice_mu=5.3,
                                         n_boot=50))  # fmt: skip
    assert "| **605 (2/2)** |" in lines and "| 5e-5 |" in lines
    assert "Measured mu: **1.00**" in lines


def test_lr_choice_rule_reached_then_compute_then_reward_then_lower_lr():
    def choice(points: dict[float, list]) -> tune.LrChoice:
        records: dict = {}
        for lr, (curves, final) in points.items():
            _tuning(records, CELL, lr, TUNE, curves, final=final)
        return tune.choose_lr(records, CELL, list(points), TUNE, TARGET, mu=1.0)

    # Reached on every tuning seed beats a lower mean over only one seed.
    assert choice({1e-4: ([_curve(10, 1), NEVER], 0.6), 2e-4: ([_curve(90, 9)] * 2, 0.6)}).lr == (
        2e-4
    )
    # Equal reach: the lower mean compute.
    assert choice({1e-4: ([_curve(90, 9)] * 2, 0.6), 2e-4: ([_curve(50, 9)] * 2, 0.6)}).lr == 2e-4
    # No seed reached at any lr: the higher final reward.
    assert choice({5e-5: ([NEVER] * 2, 0.1), 1e-4: ([NEVER] * 2, 0.3)}).lr == 1e-4
    # An exact tie: the lower lr, whatever the grid's order.
    assert choice({2e-4: ([_curve(50, 9)] * 2, 0.6), 5e-5: ([_curve(50, 9)] * 2, 0.6)}).lr == 5e-5
    # A missing tuning run: no choice, and the run is named.
    records: dict = {}
    _tuning(records, CELL, 1e-4, TUNE, [_curve(50, 9)] * 2)
    _tuning(records, CELL, 2e-4, [100], [_curve(10, 1)])
    ch = tune.choose_lr(records, CELL, [1e-4, 2e-4], TUNE, TARGET, mu=1.0)
    assert ch.lr is None and ch.tuned is None and ch.missing == ("lr 2e-4 seed 101",)


# -- the fresh-seed saving and the tables -------------------------------------------------------
REPLAY = grid.Cell("asymre", 4, 16, pos=50)
WORSE = grid.Cell("ppo", 2, 4, pos=25)


def _fake_cache(tmp_path: Path) -> tuple[grid.Cache, dict]:
    """A cache whose hashes match the sweep's configs: on-policy, REPLAY and WORSE at 4 lrs on
    the tuning seeds (on-policy best at 1e-4, REPLAY at 5e-5, WORSE at 2e-4), each at its
    chosen lr on the fresh seeds, plus fresh runs at another lr that must not count. Returns
    the cache and the fresh-seed (uses, rollouts) at the target per chosen cell."""
    sz, cache = grid.Sizing(), grid.Cache(tmp_path / "cache.json")

    def put(cell, seed, curve, mu):
        digest = grid.config_hash(grid.build_config(BASE, cell, seed, sz, tmp_path), sz)
        cache.put(cell, seed, _record(cell, seed, curve, mu, digest))

    tuning = {  # (uses, rollouts) per lr on the tuning seeds; None: never reached
        grid.ONPOLICY: [(3000, 3000), (2500, 2500), (2000, 2000), None],
        REPLAY: [(2400, 600), (1600, 400), (2000, 500), None],
        WORSE: [None, (4000, 2000), (3600, 1800), (3000, 1500)],
    }
    for cell, points in tuning.items():
        for lr, pt in zip(GRID_LR, points):
            for k, s in enumerate(TUNE):
                put(cell.at(lr), s, NEVER if pt is None else _curve(pt[0] + k, pt[1]), mu=1.0)
    fresh = {
        grid.ONPOLICY.at(1e-4): [(2000 + 100 * k, 2000 + 100 * k) for k in range(5)],
        REPLAY.at(5e-5): [(1500 + 300 * k, 380 + 60 * k) for k in range(5)],
        WORSE.at(2e-4): [(3100, 1550)] * 5,
    }
    for cell, points in fresh.items():
        for s, (uses, rollouts) in zip(FRESH, points):
            put(cell, s, _curve(uses, rollouts), mu=3.0)
    for s in FRESH:  # REPLAY at an lr not chosen: far cheaper, must not be read
        put(REPLAY.at(2e-4), s, _curve(10, 2), mu=3.0)
    return cache, fresh


def test_fresh_saving_is_paired_by_seed_and_matches_its_definition(tmp_path, capsys):
    cache, fresh = _fake_cache(tmp_path)
    out = tmp_path / "results.md"
    args = ["--report", "--run-root", str(tmp_path), "--out", str(out), "--bootstrap", "300"]
    assert rs.main(args + ["--target", str(TARGET), "--lr-extend", "0"]) == 0
    block = out.read_text()
    mu = 1.0  # the median mu of the tuning runs (the fresh runs' 3.0 is not read)
    for m in (mu, grid.PAPER_MU):
        on = {s: u + m * r for s, (u, r) in zip(FRESH, fresh[grid.ONPOLICY.at(1e-4)])}
        best = {s: u + m * r for s, (u, r) in zip(FRESH, fresh[REPLAY.at(5e-5)])}
        point = 1 - np.mean(list(best.values())) / np.mean(list(on.values()))
        want = rep.saving(on, best, 300)  # the sweep's paired bootstrap, on hand-made inputs
        assert want["paired"] and want["n"] == 5 and want["point"] == pytest.approx(point)
        assert want["lo"] < want["point"] < want["hi"]  # the seeds differ: a real interval
        got = tune.fresh_savings(
            cache.records(), tune.choose_all(cache.records(), GRID_LR, TUNE, TARGET, 5.3),
            FRESH, TARGET, {"m": m}, 300,
        )[0]  # fmt: skip
        assert got["cell"] == REPLAY.at(5e-5) and got["onpolicy"] == grid.ONPOLICY.at(1e-4)
        for key in ("point", "lo", "hi"):
            assert got["compute"][key] == pytest.approx(want[key])
        assert got["compute"]["paired"] and got["compute"]["n"] == 5
        tag = f"mu = {m:.2f}" + (" (measured)" if m == mu else "")
        assert (
            f"* {tag}: best tuned replay cell **asymre-pos50-y4-n16-lr5e-5** (vs "
            f"ppo-y1-n1-lr1e-4); compute to target on the fresh seeds: saving "
            f"{rep.fmt_pct(want)};"
        ) in block
    assert "(paired, 5 seeds)" in block and "Measured mu: **1.00**" in block
    # WORSE's lr is the grid's highest; no cell's is its lowest.
    assert "the tuned compute is an upper bound for these cells: ppo-pos25-y2-n4 at 2e-4 " in block
    assert "(highest)." in block and "(lowest)" not in block
    # The tuned cells are not in the first sweep's table; its figures are not drawn, the
    # compute-vs-lr figure (the paper's Figure 4 view) is, and the block shows it.
    assert "| cell | y | N (rows) |" not in block
    assert [p.name for p in tmp_path.glob("*.png")] == ["results_lr.png"]
    assert "![compute to target vs lr](results_lr.png)" in block


def test_a_choice_at_an_end_of_the_grid_widens_it(tmp_path, monkeypatch, capsys):
    """WORSE's lr is the grid's highest, 2e-4: with one widening it needs runs at 4e-4 and has
    no lr until they exist; then it is chosen over the wider grid. Cells chosen inside the
    grid are not widened. --tune runs exactly the widenings' runs, then stops."""
    cache, _ = _fake_cache(tmp_path)
    records = cache.records()
    wide = tune.choose_lr(records, WORSE, GRID_LR, TUNE, TARGET, 5.3, extend=1)
    assert wide.lr is None and wide.grid == (*GRID_LR, 4e-4)
    assert wide.missing == ("lr 4e-4 seed 100 101",)
    for cell in (REPLAY, grid.ONPOLICY):  # 5e-5 and 1e-4: inside the grid
        assert tune.choose_lr(records, cell, GRID_LR, TUNE, TARGET, 5.3, 1).grid == tuple(GRID_LR)
    choices = tune.choose_all(records, GRID_LR, TUNE, TARGET, 5.3, extend=1)
    assert tune.to_run(choices, TUNE, records) == [WORSE.at(4e-4)]
    assert tune.extended_grid(GRID_LR, 2) == [6.25e-6, 1.25e-5, *GRID_LR, 4e-4, 8e-4]

    sz = grid.Sizing()

    def finish(cells, points):
        """Runs landing in the cache as the runner would leave them (here: made by hand)."""
        for cell in cells:
            for k, s in enumerate(TUNE):
                digest = grid.config_hash(grid.build_config(BASE, cell, s, sz, tmp_path), sz)
                curve = NEVER if points is None else _curve(points[0] + k, points[1])
                cache.put(cell, s, _record(cell, s, curve, 1.0, digest))
        cache.save()

    ran = []

    def fake_run(args, argv, sz_, cache_, base, cells, seeds):
        ran.append(sorted(c.name for c in cells))
        finish([c for c in cells if c == WORSE.at(4e-4)], (2000, 1000))  # cheaper there
        return 0

    monkeypatch.setattr(rs, "_run", fake_run)
    argv = ["--tune", "--cells", REPLAY.name, WORSE.name, "--run-root", str(tmp_path)]
    assert rs.main(argv + ["--target", str(TARGET)]) == 0
    assert ran[1:] == [[WORSE.at(4e-4).name]]  # the grid, then one widening, then done
    records = grid.Cache(tmp_path / "cache.json").records()
    chosen = tune.choose_lr(records, WORSE, GRID_LR, TUNE, TARGET, 5.3, extend=1)
    assert chosen.lr == 4e-4 and tune.grid_edges({WORSE: chosen}) == [
        "ppo-pos25-y2-n4 at 4e-4 (highest)"
    ]
    # Worse at the widened lr: the choice goes back inside, and no end is flagged.
    finish([WORSE.at(4e-4)], None)
    back = tune.choose_lr(cache.records(), WORSE, GRID_LR, TUNE, TARGET, 5.3, extend=1)
    assert back.lr == 2e-4 and tune.grid_edges({WORSE: back}) == []


def test_compute_vs_lr_table_rows(tmp_path):
    cache, _ = _fake_cache(tmp_path)
    choices = tune.choose_all(cache.records(), GRID_LR, TUNE, TARGET, 5.3)
    assert [c.lr for c in choices.values()] == [5e-5, 1e-4, 2e-4]  # sorted: REPLAY, on, WORSE

    def mean(uses: float, rollouts: float, m: float) -> str:  # seeds at uses and uses + 1
        return f"{uses + 0.5 + m * rollouts:,.0f}"

    m = 2.0
    rows = tune.lr_table_rows(choices, GRID_LR, m)
    assert rows[0] == [
        "asymre-pos50-y4-n16", f"{mean(2400, 600, m)} (2/2)", f"**{mean(1600, 400, m)} (2/2)**",
        f"{mean(2000, 500, m)} (2/2)", "- (0/2)", "5e-5",
    ]  # fmt: skip
    assert rows[1] == [
        "ppo-y1-n1 (on-policy)", f"{mean(3000, 3000, m)} (2/2)", f"{mean(2500, 2500, m)} (2/2)",
        f"**{mean(2000, 2000, m)} (2/2)**", "- (0/2)", "1e-4",
    ]  # fmt: skip
    assert rows[2] == [
        "ppo-pos25-y2-n4", "- (0/2)", f"{mean(4000, 2000, m)} (2/2)",
        f"{mean(3600, 1800, m)} (2/2)", f"**{mean(3000, 1500, m)} (2/2)**", "2e-4",
    ]  # fmt: skip
    # The frontier: at each lr the cheapest replay cell that reached the target on both seeds
    # (on-policy is not a replay cell); last, the best replay cell at its chosen lr.
    assert rows[3] == [
        "replay frontier", f"{mean(2400, 600, m)} asymre-pos50-y4-n16",
        f"{mean(1600, 400, m)} asymre-pos50-y4-n16", f"{mean(2000, 500, m)} asymre-pos50-y4-n16",
        f"{mean(3000, 1500, m)} ppo-pos25-y2-n4", "asymre-pos50-y4-n16 at 5e-5",
    ]  # fmt: skip
    assert len(rows) == 4
    table = tune.lr_table(choices, GRID_LR, m)
    assert table.splitlines()[0] == "| cell | lr 2.5e-5 | lr 5e-5 | lr 1e-4 | lr 2e-4 | chosen lr |"


# -- the real-model comparison (--start base, item 4) ------------------------------------------
def _arms_cache(tmp_path: Path, arms: dict) -> grid.Cache:
    """A cache of ``arms`` (cell at its lr -> (uses, rollouts) at the target per seed 0, 1, 2)."""
    sz, cache = grid.Sizing(), grid.Cache(tmp_path / "cache.json")
    for cell, points in arms.items():
        for s, (uses, rollouts) in enumerate(points):
            digest = grid.config_hash(grid.build_config(BASE, cell, s, sz, tmp_path), sz)
            cache.put(cell, s, _record(cell, s, _curve(uses, rollouts), 0.5, digest))
    cache.save()
    return cache


def test_arms_at_named_lrs_are_compared_as_cells(tmp_path, capsys):
    """Item 4's report: on-policy and one replay cell, each at the lr the tuned sweep gave it,
    on seeds outside the protocol's: the tables compare them with on-policy as the baseline
    (the saving paired by seed), and no tuned section is written for them."""
    on_pts = [(2000, 2000), (2400, 2400), (2200, 2200)]
    rep_pts = [(1800, 450), (2600, 650), (2000, 500)]
    _arms_cache(tmp_path, {grid.ONPOLICY.at(5e-4): on_pts, REPLAY.at(2.5e-4): rep_pts})
    out = tmp_path / "results.md"
    args = ["--report", "--run-root", str(tmp_path), "--out", str(out), "--bootstrap", "300"]
    assert rs.main(args + ["--target", str(TARGET)]) == 0
    block = out.read_text()
    assert (
        "Arms, each at its own lr: asymre-pos50-y4-n16 at lr 2.5e-4; ppo-y1-n1 (on-policy) "
        "at lr 5e-4." in block
    )
    assert "| asymre-pos50-y4-n16 | 4 | 16x" in block and "| ppo-y1-n1 (on-policy) | 1 |" in block
    for m, tag in ((0.5, "mu = 0.50 (measured)"), (grid.PAPER_MU, f"mu = {grid.PAPER_MU}")):
        want = rep.saving(
            {s: u + m * r for s, (u, r) in enumerate(on_pts)},
            {s: u + m * r for s, (u, r) in enumerate(rep_pts)},
            300,
        )
        assert want["paired"] and want["n"] == 3
        line = f"* {tag}: best replay cell **asymre-pos50-y4-n16**; compute to {TARGET} vs "
        assert line + f"on-policy: saving {rep.fmt_pct(want)};" in block
    assert "### Tuned lr per cell" not in block and "chosen before these runs" in block
    # A cell at two lrs outside the protocol's seeds: which is its arm? Refused.
    _arms_cache(tmp_path, {REPLAY.at(1e-4): rep_pts})
    with pytest.raises(SystemExit, match="asymre-pos50-y4-n16 ran at two lrs"):
        rs.main(args + ["--target", str(TARGET)])


def _base_config(tmp_path: Path) -> Path:
    """A config like examples/smollm2_arith.toml (model folder, LoRA, its own task and greedy
    eval) on a tiny model folder, so a run takes seconds."""
    from trainer.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "base-model", task="arith", seed=0)
    path = tmp_path / "real.toml"
    path.write_text(
        f"""
[model]
path = "{model}"
lora = {{ rank = 4, alpha = 8 }}
[task]
name = "arith"
options = {{ min_operands = 2, max_operands = 2, max_digits = 1, ops = ["+"] }}
[generation]
backend = "hf"
max_tokens = 4
[loss]
loss_type = "ppo"
[optim]
lr = 5e-4
[run]
dir = "unused"
[eval]
greedy = true
"""
    )
    return path


def test_base_start_keeps_the_configs_model_task_and_eval(tmp_path):
    base = load_base(_base_config(tmp_path))
    sz = grid.Sizing(start="base", prompts_per_round=4, group_size=4, batch_size=8)
    cfg = grid.build_config(base, grid.parse_cell("asymre-pos50-y2-n4"), 3, sz, tmp_path / "runs")
    assert cfg.model.path == str((tmp_path / "base-model").resolve())  # not the warm start
    assert cfg.model.lora is not None and cfg.model.lora.rank == 4
    assert cfg.task.name == "arith" and cfg.generation.max_tokens == 4  # not carry_add's
    assert cfg.eval.greedy and cfg.eval.prompts == sz.eval_prompts
    assert (cfg.loss.loss_type, cfg.replay.positive_fraction) == ("asymre", 0.5)
    assert cfg.replay.window == 4 * 16 and cfg.run.updates_per_round == 4  # y x R / B
    warm = grid.Sizing(prompts_per_round=4, group_size=4, batch_size=8)
    assert grid.config_hash(cfg, sz) != grid.config_hash(
        grid.build_config(base, grid.parse_cell("asymre-pos50-y2-n4"), 3, warm, tmp_path / "r"),
        warm,
    )
    with pytest.raises(ValueError, match="not a model folder"):
        grid.build_config({**base, "model": {"path": "no/such"}}, grid.ONPOLICY, 0, sz, tmp_path)
    with pytest.raises(ValueError, match="--start 'cold'"):
        grid.build_config(base, grid.ONPOLICY, 0, grid.Sizing(start="cold"), tmp_path)


def test_base_start_runs_both_arms_from_the_model_folder(tmp_path, keep_torch_threads):
    """--start base end to end: no warm start is trained (warm.json holds the base model's
    held-out pass@k), on-policy and a replay cell run with LoRA and land in the cache."""
    conf = _base_config(tmp_path)
    runs = tmp_path / "runs"
    args = [
        "--config", str(conf), "--start", "base", "--run-root", str(runs),
        "--cells", "onpolicy", "ppo-y2-n4", "--seeds", "0", "--budget-rounds", "2",
        "--evals", "2", "--eval-prompts", "4", "--passk-prompts", "2", "--passk-samples", "4",
        "--prompts-per-round", "2", "--group-size", "4", "--batch-size", "8",
    ]  # fmt: skip
    assert rs.main(args) == 0
    data = json.loads((runs / "cache.json").read_text())
    assert data["warm"]["spec"]["start"] == "base" and 0 <= data["warm"]["pass1"] <= 1
    assert data["warm"]["weights"] == grid.weights_digest(tmp_path / "base-model")  # its identity
    assert sorted(p.name for p in (runs / "warm").iterdir()) == ["warm.json"]  # nothing trained
    assert set(data["runs"]) == {"ppo-y1-n1/s0", "ppo-y2-n4/s0"}
    on, rep = data["runs"]["ppo-y1-n1/s0"], data["runs"]["ppo-y2-n4/s0"]
    assert on["uses"] == on["rollouts"] and rep["uses"] == 2 * rep["rollouts"]  # y
    run = json.loads((runs / "ppo-y2-n4" / "s0" / "run.json").read_text())
    assert run["config"]["model"]["lora"]["rank"] == 4, run.keys()


# -- the theory check (item 5) -----------------------------------------------------------------
def test_break_even_mu_follows_the_compute_model():
    # More passes, fewer rollouts: cheaper above (U - U0) / (G0 - G).
    kind, mu = theory.break_even(3100, 1550, 2200, 2200)
    assert kind == "above" and mu == pytest.approx(900 / 650)
    assert 3100 + (mu + 0.01) * 1550 < 2200 + (mu + 0.01) * 2200  # just above: cheaper
    assert 3100 + (mu - 0.01) * 1550 > 2200 + (mu - 0.01) * 2200  # just below: dearer
    assert theory.break_even(2000, 2500, 2200, 2200) == ("below", pytest.approx(200 / 300))
    assert theory.break_even(2100, 500, 2200, 2200)[0] == "always"
    assert theory.break_even(2300, 2300, 2200, 2200)[0] == "never"
    assert theory.break_even(2200, 2200, 2200, 2200)[0] == "never"  # equal: never cheaper
    assert theory.fmt_break_even("above", 1.3846) == "mu > 1.38"


def test_spearman_ranks_with_ties():
    assert theory.spearman([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert theory.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert theory.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)
    assert math.isnan(theory.spearman([1, 2], [1, 2])) and math.isnan(
        theory.spearman([1] * 3, [1, 2, 3])
    )


def test_theory_check_on_the_fresh_seeds(tmp_path):
    cache, fresh = _fake_cache(tmp_path)
    records = cache.records()
    stale = {grid.ONPOLICY.at(1e-4): 0.0, REPLAY.at(5e-5): 1.5, WORSE.at(2e-4): 4.0}
    for cell, var in stale.items():
        for rec in records[cell].values():
            rec.update(staleness_mean=var / 2, staleness_var=var, approx_kl_mean=1e-3 * (1 + var))
    check = theory.theory_check(records, list(stale), FRESH, TARGET, 1.0)
    pts = check["points"]
    for cell in stale:  # mean passes and rollouts to target over the fresh seeds
        assert pts[cell]["uses"] == pytest.approx(np.mean([u for u, _ in fresh[cell]]))
        assert pts[cell]["rollouts"] == pytest.approx(np.mean([g for _, g in fresh[cell]]))
        assert pts[cell]["reached"] == 5 and pts[cell]["staleness_var"] == stale[cell]
    assert pts[REPLAY.at(5e-5)]["break_even"][0] == "always"  # fewer passes and fewer rollouts
    kind, mu = pts[WORSE.at(2e-4)]["break_even"]
    assert kind == "above" and mu == pytest.approx((3100 - 2200) / (2200 - 1550))
    assert check["onpolicy_least_passes"] is False  # REPLAY needs fewer passes than on-policy
    assert check["best"] == {"measured": REPLAY.at(5e-5), "paper": REPLAY.at(5e-5)}
    assert math.isnan(check["staleness_vs_passes"])  # two replay cells: no correlation
    lines = "\n".join(theory.theory_lines(check, 1.0, "fresh seeds"))
    assert f"| {WORSE.at(2e-4).label()} | 5/5 | 3,100 | 1,550 | mu > 1.38 | 2.00 | 4.00 |" in lines
    assert "optimal as mu -> 0'): **no**." in lines and "spread)" in lines  # nan: not a figure
    # On-policy alone (tuning under way): nothing to compare, which is not a "no".
    alone = theory.theory_check(records, [grid.ONPOLICY.at(1e-4)], FRESH, TARGET, 1.0)
    assert alone["onpolicy_least_passes"] is None
    assert "no comparison yet" in "\n".join(theory.theory_lines(alone, 1.0, "tuning seeds"))
    # A cell not run on these seeds yet (evaluation under way) gets no row of NaNs: it is named.
    unrun = grid.ONPOLICY.at(1e-4)  # any cell absent from the records
    part = theory.theory_check({}, [unrun], FRESH, TARGET, 1.0)
    text = "\n".join(theory.theory_lines(part, 1.0, "fresh seeds"))
    assert "nan" not in text and f"Not run on the fresh seeds yet: {unrun.label()}." in text
    # The report carries the section, on the fresh seeds once they ran.
    out = tmp_path / "results.md"
    args = ["--report", "--run-root", str(tmp_path), "--out", str(out), "--bootstrap", "100"]
    assert rs.main(args + ["--target", str(TARGET)]) == 0
    block = out.read_text()
    assert "#### Theory check (issue #30 item 5)" in block and "On the fresh seeds" in block


def test_evaluation_runs_onpolicy_then_the_best_cells_each_on_every_fresh_seed(
    tmp_path, monkeypatch
):
    """--evaluate's order: on-policy, then the replay cells from the best on the tuning seeds
    down (REPLAY reached on both seeds at 5e-5, WORSE at a dearer 2e-4), each cell on all its
    fresh seeds before the next; --tune keeps seed-major jobs."""
    cache, _ = _fake_cache(tmp_path)
    choices = list(tune.choose_all(cache.records(), GRID_LR, TUNE, TARGET, 5.3).values())
    want = [grid.ONPOLICY.at(1e-4), REPLAY.at(5e-5), WORSE.at(2e-4)]
    for order in (choices, choices[::-1]):  # whatever order the cells were named in
        assert tune.evaluation_order(order, 5.3) == want
    untuned = tune.LrChoice(WORSE, (), ("lr 1e-4 seed 100",), None)
    assert tune.evaluation_order([untuned, *choices], 5.3) == want  # no lr: left out

    sz = grid.Sizing()
    empty = grid.Cache(tmp_path / "empty.json")
    cm = rs.make_jobs(BASE, want, FRESH[:2], sz, tmp_path, empty, cell_major=True)
    sm = rs.make_jobs(BASE, want, FRESH[:2], sz, tmp_path, empty)
    pairs = [(c.name, s) for c in want for s in FRESH[:2]]
    assert [(j["cell"], j["seed"]) for j in cm] == pairs
    assert [(j["cell"], j["seed"]) for j in sm] == sorted(pairs, key=lambda p: p[1])

    # Through the command: the jobs --evaluate hands the runner (fresh seeds the fake cache
    # has no runs on, so none is skipped), cells best first and cell-major.
    ran = []
    monkeypatch.setattr(rs, "run_jobs", lambda jobs, cache, **kw: ran.append(jobs) or 0)
    fresh = ["--fresh-seeds", "300", "301", "302", "303", "304"]
    names = ["--cells", WORSE.name, REPLAY.name, "--run-root", str(tmp_path), *fresh]
    assert rs.main(["--evaluate", *names, "--target", str(TARGET), "--lr-extend", "0"]) == 0
    assert [(j["cell"], j["seed"]) for j in ran[0]] == [
        (c.name, s) for c in want for s in range(300, 305)
    ]
