"""Whether two runs are the same run: the check of exact resume, as a command.

    rolloutstore-train compare runs/arith runs/arith-resumed

Compares, in this order, each learner step's drawn rollout ids (every row of the store's
``usage`` table for the run's own id, so a step recorded twice is a difference too) and the
final weights (the newest checkpoint's ``model.safetensors``, tensor by tensor, bit for bit),
and names the first difference. Use it on a run killed and resumed against the same config run
uninterrupted, or on twin runs (the same config and seed in two folders): with the default
``[run].ids = "seeded"`` their rollout ids agree; with ``"clock"`` only runs sharing
``run_id`` and ``id_time_ms`` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.errors import RunDirError


@dataclass(frozen=True)
class Comparison:
    """The outcome: ``difference`` is None when the runs agree; ``line()`` says so."""

    steps: int
    checkpoint_step: int | None
    difference: str | None

    def line(self) -> str:
        if self.difference is not None:
            return f"first difference: {self.difference}"
        return (
            f"identical: {self.steps} learner steps drew the same rollouts, final weights "
            f"(checkpoint step {self.checkpoint_step}) equal bit for bit"
        )


def draws(run_dir: Path) -> dict[int, list[str]]:
    """Every usage row of the run's own id: ``{learner_step: sorted rollout ids}``."""
    from rolloutstore import RolloutStore
    from trainer.run.resume import read_run_meta

    if not (run_dir / "store").is_dir():
        raise RunDirError(f"{run_dir}: no store folder; give a run folder (RUN_DIR of a run)")
    run_id = read_run_meta(run_dir)["run_id"]
    rows = (
        RolloutStore.open(run_dir / "store", create=False)
        .sql("SELECT learner_step, rollout_id FROM usage WHERE run_id = ? ORDER BY 1, 2", [run_id])
        .to_pylist()
    )
    out: dict[int, list[str]] = {}
    for r in rows:
        out.setdefault(r["learner_step"], []).append(r["rollout_id"])
    return out


def _first_draw_difference(a: dict[int, list[str]], b: dict[int, list[str]]) -> str | None:
    for step in sorted(a.keys() | b.keys()):
        x, y = a.get(step), b.get(step)
        if x is None or y is None:
            which = "A" if x is None else "B"
            return f"learner step {step}: run {which} recorded no draw"
        if x != y:
            if len(x) != len(y):
                return f"learner step {step}: usage rows {len(x)} (A) vs {len(y)} (B)"
            i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
            return f"learner step {step}: rollout {x[i]} (A) vs {y[i]} (B) in sorted draw order"
    return None


def _final_weights(run_dir: Path) -> tuple[int, Path]:
    from trainer.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise RunDirError(f"{run_dir}: no checkpoint; compare needs a run that saved one")
    return int(ckpt.name.rsplit("-", 1)[-1]), ckpt / "model.safetensors"


def _first_weight_difference(a: Path, b: Path) -> str | None:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    if wa.keys() != wb.keys():
        only = sorted(wa.keys() ^ wb.keys())[0]
        return f"final weights: tensor {only} is in one run only"
    for name in sorted(wa):
        x, y = wa[name], wb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"final weights: tensor {name} is {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if not torch.equal(x, y):
            gap = (x.float() - y.float()).abs().max().item()
            return f"final weights: tensor {name} differs (max |a - b| = {gap:.3g})"
    return None


def compare_runs(run_a: str | Path, run_b: str | Path) -> Comparison:
    """Compare two run folders (see the module docstring)."""
    a, b = Path(run_a), Path(run_b)
    da, db = draws(a), draws(b)
    (step_a, wa), (step_b, wb) = _final_weights(a), _final_weights(b)
    diff = _first_draw_difference(da, db)
    if diff is None and step_a != step_b:
        diff = f"final checkpoints: step {step_a} (A) vs step {step_b} (B)"
    if diff is None:
        diff = _first_weight_difference(wa, wb)
    return Comparison(steps=len(da), checkpoint_step=step_a, difference=diff)
