"""The loop both training modes run: learner steps with their evals, checkpoints and records.

    first evaluation (a fresh run)
    repeat until done (run.steps learner steps; sync: or the token budget spent):
        before_step: sync: a generation round when one is due
                     async: the actors checked, then a wait for run.min_rows eligible rows
        one learner step on the next batch the loader draws
        its train record -> metrics.jsonl, the progress bar (the replayed batch's reward and
                            the policy's own: policy_reward, its newest round's mean reward)
        an evaluation every run.eval_every steps and at the end
        a checkpoint every run.checkpoint_every steps and at the end
    finish: sync: the final weights published (async publishes after every step)
    always: close the metrics, the generators, the actors

:class:`Loop` is that loop, once; :class:`trainer.run.sync.SyncLoop` and
:class:`trainer.run.async_learner.AsyncLoop` set their run up in ``__init__`` and override the
few steps that differ (the methods under "what a loop fills in"). The order of the metrics
records and the learner's crash-injection point (``step:N``) are this file's.
"""

from __future__ import annotations

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

    def run(self, *, progress: bool = True) -> TrainResult:
        from tqdm.auto import tqdm

        r = self.cfg.run
        self.bar = tqdm(
            total=r.steps, initial=self.step, desc="train", unit="step",
            disable=not (progress and self.main),
        )  # fmt: skip
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
                self.totals["train_seconds"] += time.perf_counter() - t0
                self.step += 1
                m = self.after_step(m, batch)
                if self.main:
                    self.metrics.log("train", self.step, m)
                crash_at(f"step:{self.step}")
                self.bar.update(1)
                self.bar.set_postfix(postfix(m))
                if due(self.step, r.eval_every, self.done()):
                    self._evaluate(first=False)
                if due(self.step, r.checkpoint_every, self.done()):
                    self.checkpoint()
            self.finish()
        finally:
            self.bar.close()
            self.close()
        return TrainResult(self.run_dir, self.store_uri, self.step, self.first_eval, self.last_eval)

    def done(self) -> bool:
        return self.step >= self.cfg.run.steps

    def _evaluate(self, *, first: bool) -> None:
        reward = self.evaluate()
        if not self.main:
            return
        if first:
            self.first_eval = self.last_eval = reward
            # At zero generated tokens, where the loop's eval records carry that total.
            zero = {"generated_tokens": 0} if "generated_tokens" in self.totals else {}
            self.metrics.log("eval", self.step, {"reward": reward, **zero})
        else:
            self.last_eval = reward
            self.metrics.log("eval", self.step, {"reward": reward, **self.totals})
            self.bar.write(
                f"step {self.step}: eval reward {reward:.3f} (start {self.first_eval:.3f})"
            )

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

    def evaluate(self) -> float | None:
        """The eval reward of the learner's current weights (None off rank 0)."""
        raise NotImplementedError

    def checkpoint(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last step."""

    def close(self) -> None:
        """Always, at the end: what the run opened."""
