"""The loop both training modes run: learner steps with their evals, checkpoints and records.

    first evaluation (a fresh run)
    repeat until done (run.steps learner steps; sync: or the token budget spent):
        before_step: sync: a generation round when one is due
                     async: the actors checked, then a wait for run.min_rows eligible rows
        one learner step on the next batch the loader draws
        its train record -> metrics.jsonl, the progress bar (the replayed batch's reward and
                            the policy's own: policy_reward, its newest round's mean reward)
        an evaluation every eval.every steps and at the end
        a checkpoint every run.checkpoint_every steps and at the end
    finish: sync: the final weights published (async publishes after every step)
    the run's time accounted (RUN_DIR/summary.json, one line, a "summary" record)
    always: close the metrics, the generators, the actors

Where the time goes, in ``totals`` (every train and eval record carries them; checkpoints keep
them, so they add up across resumes): ``startup_seconds`` (the loop's set-up: model, store,
learner, warm start, the generator's first build or engine start), ``gen_seconds`` (generation
rounds), ``sync_seconds`` (bringing the generator to the learner's weights after each update:
gather / merge, load, verification), ``train_seconds`` (draws and learner steps),
``eval_seconds``, ``checkpoint_seconds``, and ``wall_seconds``, the run's wall time.

:class:`Loop` is that loop, once; :class:`trainer.run.sync.SyncLoop` and
:class:`trainer.run.async_learner.AsyncLoop` set their run up in ``__init__`` and override the
few steps that differ (the methods under "what a loop fills in"). The order of the metrics
records and the learner's crash-injection point (``step:N``) are this file's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutstore.errors import EmptyBufferError
from trainer.errors import BufferExhaustedError
from trainer.run.faults import crash_at
from trainer.run.setup import TrainResult

if TYPE_CHECKING:
    from rolloutstore.replay.loader import ReplayDataset
    from trainer.algo.learner import Learner
    from trainer.config import TrainConfig
    from trainer.rollout.evaluation import EvalResult
    from trainer.run.metrics import Metrics


def postfix(m: dict[str, Any]) -> dict[str, str]:
    """The progress bar's postfix from a train record: the replayed batch's reward beside the
    policy's own (its newest generation round's mean reward; replay can keep the first high
    while the policy scores near 0), and the loss."""
    out = {"replayed": f"{m['reward']:.2f}"}
    if m.get("policy_reward") is not None:
        out["policy"] = f"{m['policy_reward']:.2f}"
    out["loss"] = f"{m['loss']:.3f}"
    return out


# The time totals every loop keeps (checkpoints of earlier versions lack some: they start at 0).
TIME_KEYS = (
    "startup_seconds", "gen_seconds", "sync_seconds", "train_seconds", "eval_seconds",
    "checkpoint_seconds", "wall_seconds",
)  # fmt: skip


def time_summary(totals: dict[str, float], steps: int, batch_size: int) -> dict[str, float]:
    """The run's time accounting: each part, ``other_seconds`` (wall time in none of them: the
    loop's bookkeeping, records, waits) and, where the run generated, mu = generation seconds
    per rollout / learner seconds per rollout use (a use: one row of one drawn batch), and
    ``mu_with_sync``, its generation side including the weight syncs."""
    parts = {k: float(totals.get(k, 0.0)) for k in TIME_KEYS}
    other = parts["wall_seconds"] - sum(v for k, v in parts.items() if k != "wall_seconds")
    out = {**parts, "other_seconds": other}
    for k in ("wait_seconds",):  # async: the learner waiting for rows
        if k in totals:
            out[k] = float(totals[k])
            out["other_seconds"] -= out[k]
    rollouts, uses = totals.get("generated_rollouts", 0), steps * batch_size
    gen, train = parts["gen_seconds"], parts["train_seconds"]
    if rollouts and uses and gen > 0 and train > 0:
        per_use = train / uses
        out.update(
            generated_rollouts=int(rollouts), rollout_uses=int(uses),
            gen_seconds_per_rollout=gen / rollouts, train_seconds_per_use=per_use,
            mu=gen / rollouts / per_use, mu_with_sync=(gen + parts["sync_seconds"]) / rollouts / per_use,
        )  # fmt: skip
    return out


def time_line(s: dict[str, float]) -> str:
    """``time 123.4 s: startup 20.1, generation 50.2, sync 8.0, ...; mu 0.12 (...)``."""
    names = (
        ("startup", "startup_seconds"), ("generation", "gen_seconds"), ("sync", "sync_seconds"),
        ("train", "train_seconds"), ("eval", "eval_seconds"), ("checkpoints", "checkpoint_seconds"),
        ("waiting", "wait_seconds"), ("other", "other_seconds"),
    )  # fmt: skip
    parts = ", ".join(f"{name} {s[k]:.1f}" for name, k in names if k in s)
    line = f"time {s['wall_seconds']:.1f} s: {parts}"
    if "mu" in s:
        line += (
            f"; mu {s['mu']:.3g} (generation {s['gen_seconds_per_rollout'] * 1e3:.1f} ms per "
            f"rollout / learner {s['train_seconds_per_use'] * 1e3:.1f} ms per rollout use; "
            f"{s['mu_with_sync']:.3g} with the weight syncs)"
        )
    return line


def due(step: int, every: int, last: bool) -> bool:
    """Whether an event every ``every`` steps (0: none) is due after ``step``; the last always."""
    return bool(every and step % every == 0) or last


class Loop:
    """One run's training loop; a subclass sets these up in ``__init__``."""

    cfg: TrainConfig
    run_dir: Path
    store_uri: str
    main: bool  # rank 0: the only writer of metrics, checkpoints, weights
    learner: Learner
    loader: ReplayDataset
    metrics: Metrics | None  # None off rank 0
    step: int  # learner steps taken
    totals: dict[str, float]  # running totals (train_seconds, ...), in every eval record
    first_eval: float | None  # None until the first evaluation (a resume keeps it)
    last_eval: float | None
    t0: float  # time.perf_counter() when the loop's set-up began (startup_seconds from it)

    def run(self, *, progress: bool = True) -> TrainResult:
        from tqdm.auto import tqdm

        r, totals = self.cfg.run, self.totals
        self.bar = tqdm(
            total=r.steps, initial=self.step, desc="train", unit="step",
            disable=not (progress and self.main),
        )  # fmt: skip
        for k in TIME_KEYS:
            totals.setdefault(k, 0.0)
        # This process's wall time counts from its set-up; earlier processes' (a resume) kept.
        self.wall_base = totals["wall_seconds"]
        totals["startup_seconds"] += time.perf_counter() - self.t0
        try:
            self.start()
            if self.first_eval is None:
                self._evaluate(first=True)
            self.it = iter(self.loader)
            while not self.done():
                self.before_step()
                t0 = time.perf_counter()
                batch = self.draw()
                if batch is None:  # async: no batch after all; wait for rows again
                    continue
                m = self.learner.step(batch)
                totals["train_seconds"] += time.perf_counter() - t0
                self.step += 1
                self._tick()
                m = self.after_step(m, batch)
                if self.main:
                    self.metrics.log("train", self.step, m)
                crash_at(f"step:{self.step}")
                self.bar.update(1)
                self.bar.set_postfix(postfix(m))
                if due(self.step, self.cfg.eval.every, self.done()):
                    self._evaluate(first=False)
                if due(self.step, r.checkpoint_every, self.done()):
                    t0 = time.perf_counter()
                    self._tick()
                    self.checkpoint()
                    totals["checkpoint_seconds"] += time.perf_counter() - t0
            self.finish()
            self._tick()
            timing = time_summary(totals, self.step, r.batch_size) if self.main else None
            if timing is not None:
                self._report_time(timing)
        finally:
            self.bar.close()
            self.close()
        return TrainResult(
            self.run_dir, self.store_uri, self.step, self.first_eval, self.last_eval, timing
        )

    def _tick(self) -> None:
        """``wall_seconds`` brought up to now (records and checkpoints carry it)."""
        self.totals["wall_seconds"] = self.wall_base + time.perf_counter() - self.t0

    def _report_time(self, timing: dict[str, float]) -> None:
        """The run's time accounting: RUN_DIR/summary.json, a "summary" record, one line."""
        path = self.run_dir / "summary.json"
        tmp = path.with_name(".summary.json.tmp")
        tmp.write_text(json.dumps({"steps": self.step, **timing}, indent=2))
        tmp.replace(path)
        self.metrics.log("summary", self.step, timing)
        self.bar.write(time_line(timing))

    def done(self) -> bool:
        return self.step >= self.cfg.run.steps

    def _evaluate(self, *, first: bool) -> None:
        totals = self.totals
        synced = ("sync_seconds", "startup_seconds")
        t0, sync0 = time.perf_counter(), sum(totals.get(k, 0.0) for k in synced)
        result = self.evaluate()
        # The generator's sync before it is sync time (the first: building the generator,
        # start-up time), counted there; the rest eval time.
        sync1 = sum(totals.get(k, 0.0) for k in synced)
        totals["eval_seconds"] += time.perf_counter() - t0 - (sync1 - sync0)
        self._tick()
        if not self.main:
            return
        reward = float("nan") if result is None else result.reward
        fields = {"reward": reward} if result is None else result.record()
        if first:
            self.first_eval = self.last_eval = reward
            # At zero generated tokens, where the loop's eval records carry that total.
            zero = {"generated_tokens": 0} if "generated_tokens" in totals else {}
            self.metrics.log("eval", self.step, {**fields, **zero})
        else:
            self.last_eval = reward
            self.metrics.log("eval", self.step, {**totals, **fields})
            shown = f"{reward:.3f}" if result is None else result.line()
            self.bar.write(f"step {self.step}: eval reward {shown} (start {self.first_eval:.3f})")

    # -- what a loop fills in ----------------------------------------------------------------
    def start(self) -> None:
        """Before the first evaluation (async: the actors start)."""

    def before_step(self) -> None:
        """Before each learner step: whatever makes the next batch drawable."""

    def draw(self) -> dict[str, Any] | None:
        """The next batch; None to go back to :meth:`before_step` first."""
        try:
            return next(self.it)
        except EmptyBufferError as exc:
            raise BufferExhaustedError(self.step + 1, self.run_dir, exc) from exc

    def after_step(self, m: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
        """Once a learner step is taken (``self.step`` counts it): its train record, from the
        learner's metrics ``m``."""
        raise NotImplementedError

    def evaluate(self) -> EvalResult | None:
        """The evaluation of the learner's current weights (None off rank 0, or with
        ``[eval].prompts = 0``)."""
        raise NotImplementedError

    def checkpoint(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last step."""

    def close(self) -> None:
        """Always, at the end: what the run opened."""
