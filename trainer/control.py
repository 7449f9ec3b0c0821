"""The replay-ratio controller: ``[replay.control]`` adjusts replay between generation rounds.

The sync loop (:func:`trainer.run.sync.train`) generates a round, takes ``y`` learner steps on
batches from the buffer, then generates the next round. With the controller on, ``y`` (learner
steps per round, i.e. the replay ratio up to the constant batch / rollouts-per-round) and/or the
replay ``fresh_fraction`` are chosen anew at every round boundary from what the last round's
learner steps saw:

    [replay.control]
    enabled = true
    min_updates = 1        # y stays in [min_updates, max_updates]
    max_updates = 4
    target_ess = 0.9       # mean ESS fraction of the importance weights must stay above
    max_clip = 0.05        # mean clip fraction (low + high) must stay below
    max_kl = 0.02          # mean approx KL(mu -> pi) of the replayed tokens must stay below

The rule, applied once per round to the means over that round's learner steps:

1. **Too off-policy** when any of: ESS fraction < ``target_ess``; clip fraction > ``max_clip``;
   approx KL > ``max_kl``; mean batch staleness > ``max_mean_staleness`` (when set); the on-policy
   reward of the last ``reward_window`` generation rounds falls (least-squares slope times
   ``reward_window - 1`` < ``-reward_drop``, and below ``-reward_z`` standard errors of that
   fitted change, so that round-to-round sampling noise does not count as a fall). Then make replay more on-policy at once: lower
   ``y`` by ``updates_step``, or, when ``y`` is already at ``min_updates`` (or only
   ``fresh_fraction`` is controlled), raise ``fresh_fraction`` by ``fresh_step``.
2. **Comfortable** when every signal is well inside its target: ``1 - ESS <= margin *
   (1 - target_ess)``, clip <= ``margin * max_clip``, KL <= ``margin * max_kl``, staleness <=
   ``margin * max_mean_staleness``, and the reward is not falling. After ``patience`` comfortable
   rounds in a row, make replay more aggressive by one notch: first lower ``fresh_fraction``
   back towards ``min_fresh``, then raise ``y`` towards ``max_updates``.
3. Otherwise (inside the band between the two): hold.

Hysteresis comes from the gap between the two thresholds (``margin``) and from ``patience``;
backing off is immediate, speeding up is slow. Every value is clamped to its bounds and at
most one knob moves per round. Each decision, changed or not, is logged by the loop as a
``control`` metrics record holding its inputs, the old and new values and the reason.

The controller is a pure function of the signals it is fed; its state (current values,
accumulated signals of the round in progress, reward history, comfortable streak) is a small
JSON dict saved in every checkpoint, so a resumed run decides exactly as the uninterrupted one.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from rolloutstore.options import help_field as _h

Adjust = Literal["updates", "fresh", "both"]

# learner metric -> signal name, aggregated as the mean over the round's learner steps
SIGNALS = ("ess_frac", "clip_frac", "approx_kl", "staleness")


@dataclass(frozen=True)
class ControlConfig:
    """``[replay.control]``: bounds, targets and hysteresis of the replay-ratio controller."""

    enabled: bool = _h("adjust updates per round / fresh_fraction between rounds", False)
    adjust: Adjust = _h("which knob(s): updates (y), fresh (fresh_fraction), or both", "updates")
    min_updates: int = _h("lower bound of learner steps per round (y)", 1)
    max_updates: int = _h("upper bound of learner steps per round (y)", 8)
    updates_step: int = _h("how much y moves per decision", 1)
    target_ess: float = _h("back off when the mean ESS fraction of IS weights is below", 0.9)
    max_clip: float = _h("back off when the mean clip fraction (low + high) is above", 0.05)
    max_kl: float = _h("back off when the mean approx KL(mu -> pi) of replayed data is above", 0.02)
    # Not [replay].max_staleness (the selector's bound on each row): this reads the batch mean.
    max_mean_staleness: float | None = _h(
        "back off when the mean staleness of a batch is above (None: off)", None
    )
    reward_window: int = _h("generation rounds over which the reward trend is fitted", 6)
    reward_drop: float = _h("back off when the fitted reward falls more than this", 0.05)
    reward_z: float = _h(
        "... and by more than this many standard errors of the fit (0: ignore noise)", 2.0
    )
    margin: float = _h("comfortable = every signal within margin x its target (hysteresis)", 0.5)
    patience: int = _h("comfortable rounds in a row before replaying more aggressively", 2)
    min_fresh: float = _h("lower bound of fresh_fraction", 0.0)
    max_fresh: float = _h("upper bound of fresh_fraction", 0.5)
    fresh_step: float = _h("how much fresh_fraction moves per decision", 0.125)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be true or false, got {self.enabled!r}")
        if self.adjust not in typing.get_args(Adjust):
            raise ValueError(
                f"adjust must be one of {typing.get_args(Adjust)}, got {self.adjust!r}"
            )
        for name in ("min_updates", "max_updates", "updates_step", "reward_window", "patience"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.min_updates > self.max_updates:
            raise ValueError(
                f"min_updates ({self.min_updates}) must be <= max_updates ({self.max_updates})"
            )
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be finite, got {v!r}")
        if not 0.0 < self.target_ess < 1.0:
            raise ValueError(f"target_ess must be in (0, 1), got {self.target_ess!r}")
        if not self.reward_z >= 0:
            raise ValueError(f"reward_z must be >= 0, got {self.reward_z!r}")
        for name in ("max_clip", "max_kl", "reward_drop", "fresh_step"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_mean_staleness is not None and not self.max_mean_staleness > 0:
            raise ValueError(
                f"max_mean_staleness must be > 0 or None, got {self.max_mean_staleness!r}"
            )
        if not 0.0 < self.margin < 1.0:
            raise ValueError(f"margin must be in (0, 1), got {self.margin!r}")
        if not 0.0 <= self.min_fresh <= self.max_fresh <= 1.0:
            raise ValueError(
                f"need 0 <= min_fresh <= max_fresh <= 1, got {self.min_fresh!r}, {self.max_fresh!r}"
            )


@dataclass(frozen=True)
class Decision:
    """One round boundary's decision: inputs, old and new values, and why."""

    round: int
    inputs: dict[str, float | None]
    old_updates: int
    new_updates: int
    old_fresh: float
    new_fresh: float
    verdict: Literal["back_off", "hold", "speed_up", "no_data"]
    reason: str

    @property
    def changed(self) -> bool:
        return (self.old_updates, self.old_fresh) != (self.new_updates, self.new_fresh)

    def record(self) -> dict[str, Any]:
        """The ``control`` metrics record (inputs flattened as ``in_<signal>``)."""
        return {
            "round": self.round,
            **{f"in_{k}": v for k, v in self.inputs.items()},
            "old_updates_per_round": self.old_updates,
            "updates_per_round": self.new_updates,
            "old_fresh_fraction": self.old_fresh,
            "fresh_fraction": self.new_fresh,
            "verdict": self.verdict,
            "changed": self.changed,
            "reason": self.reason,
        }


def reward_trend(rewards: list[float]) -> float:
    """Least-squares change of ``rewards`` over their span (slope x (n - 1)); 0 for n < 2."""
    return reward_trend_se(rewards)[0]


def reward_trend_se(rewards: list[float]) -> tuple[float, float]:
    """(least-squares change over the span, its standard error from the fit's residuals).

    The error is ``inf`` with fewer than 3 points (no residual degrees of freedom).
    """
    ys = np.asarray([r for r in rewards if math.isfinite(r)], np.float64)
    n = len(ys)
    if n < 2:
        return 0.0, math.inf
    x = np.arange(n, dtype=np.float64)
    slope, icept = np.polyfit(x, ys, 1)
    if n < 3:
        return float(slope) * (n - 1), math.inf
    resid = ys - (slope * x + icept)
    se_slope = math.sqrt(float(resid @ resid) / (n - 2) / float(((x - x.mean()) ** 2).sum()))
    return float(slope) * (n - 1), se_slope * (n - 1)


class ReplayController:
    """Feed it each learner step's metrics and each round's reward; ask it at round boundaries."""

    def __init__(self, cfg: ControlConfig, *, updates: int, fresh: float):
        self.cfg = cfg
        self.updates = min(max(int(updates), cfg.min_updates), cfg.max_updates)
        self.fresh = float(fresh)
        if cfg.adjust != "updates":
            self.fresh = min(max(self.fresh, cfg.min_fresh), cfg.max_fresh)
        self.sums: dict[str, float] = {}
        self.count = 0
        self.rewards: list[float] = []
        self.streak = 0

    # -- feeding -----------------------------------------------------------------------
    def observe_step(self, m: dict[str, Any]) -> None:
        """Accumulate one learner step's metrics (keys of :meth:`trainer.algo.learner.Learner.step`)."""
        vals = {
            "ess_frac": m.get("ess_frac"),
            "clip_frac": (m.get("clip_frac_low") or 0.0) + (m.get("clip_frac_high") or 0.0),
            "approx_kl": m.get("approx_kl"),
            "staleness": m.get("staleness"),
        }
        for k, v in vals.items():
            if v is not None and math.isfinite(float(v)):
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.count += 1

    def observe_round_reward(self, reward: float) -> None:
        """The mean reward of a freshly generated (on-policy) round."""
        self.rewards = (self.rewards + [float(reward)])[-self.cfg.reward_window :]

    def signals(self) -> dict[str, float | None]:
        """Means over the learner steps seen since the last decision, plus the reward trend."""
        out: dict[str, float | None] = {
            k: (self.sums[k] / self.count if self.count and k in self.sums else None)
            for k in SIGNALS
        }
        full = len(self.rewards) >= self.cfg.reward_window
        trend, se = reward_trend_se(self.rewards) if full else (None, None)
        out["reward_trend"] = trend
        out["reward_trend_se"] = se if se is None or math.isfinite(se) else None
        out["steps"] = float(self.count)
        return out

    # -- deciding ----------------------------------------------------------------------
    def decide(self, rnd: int, signals: dict[str, float | None] | None = None) -> Decision:
        """Apply the module docstring's rule to ``signals`` (default: :meth:`signals`).

        Updates the current values and resets the per-round accumulation.
        """
        c, s = self.cfg, (self.signals() if signals is None else signals)
        bad, comfortable = self._judge(s)
        old_u, old_f = self.updates, self.fresh
        if all(s.get(k) is None for k in ("ess_frac", "clip_frac", "approx_kl")):
            verdict, reason = "no_data", "no learner metrics this round"
        elif bad:
            verdict, reason = "back_off", "; ".join(bad)
            self.streak = 0
            self._back_off()
        elif comfortable:
            self.streak += 1
            verdict = "speed_up" if self.streak >= c.patience else "hold"
            reason = f"all signals within {c.margin} x target ({self.streak}/{c.patience})"
            if verdict == "speed_up":
                self.streak = 0
                self._speed_up()
        else:
            verdict, reason = "hold", "within targets but not comfortably (hysteresis band)"
            self.streak = 0
        if verdict in ("back_off", "speed_up") and (old_u, old_f) == (self.updates, self.fresh):
            reason += "; already at the bound"
        self.sums, self.count = {}, 0
        return Decision(rnd, dict(s), old_u, self.updates, old_f, self.fresh, verdict, reason)

    def _judge(self, s: dict[str, float | None]) -> tuple[list[str], bool]:
        """(reasons the data are too off-policy, whether every signal is comfortably fine)."""
        c = self.cfg
        ess, clip, kl = s.get("ess_frac"), s.get("clip_frac"), s.get("approx_kl")
        stale, trend = s.get("staleness"), s.get("reward_trend")
        checks = []  # (too off-policy?, comfortably within?, reason)
        if ess is not None:
            lim = 1 - c.margin * (1 - c.target_ess)
            checks.append((ess < c.target_ess, ess >= lim, f"ess {ess:.3f} < {c.target_ess}"))
        if clip is not None:
            lim = c.margin * c.max_clip
            checks.append((clip > c.max_clip, clip <= lim, f"clip {clip:.3f} > {c.max_clip}"))
        if kl is not None:
            lim = c.margin * c.max_kl
            checks.append((kl > c.max_kl, kl <= lim, f"kl {kl:.4f} > {c.max_kl}"))
        if stale is not None and c.max_mean_staleness is not None:
            lim = c.margin * c.max_mean_staleness
            checks.append(
                (
                    stale > c.max_mean_staleness,
                    stale <= lim,
                    f"staleness {stale:.2f} > {c.max_mean_staleness}",
                )
            )
        if trend is not None:
            # A fall counts only when it exceeds reward_drop and is not within the noise of
            # the round rewards (z standard errors of the fitted change).
            se = s.get("reward_trend_se")
            noise = c.reward_z * se if se is not None else 0.0  # < 3 rounds: no noise estimate
            falling = trend < -max(c.reward_drop, noise)
            why = f"reward trend {trend:+.3f} < -{c.reward_drop}"
            if se is not None:
                why += f" and < -{c.reward_z} x se {se:.3f}"
            checks.append((falling, not falling, why))
        bad = [why for too_far, _, why in checks if too_far]
        return bad, bool(checks) and all(ok for _, ok, _ in checks)

    def _back_off(self) -> None:
        c = self.cfg
        if c.adjust != "fresh" and self.updates > c.min_updates:
            self.updates = max(c.min_updates, self.updates - c.updates_step)
        elif c.adjust != "updates" and self.fresh < c.max_fresh:
            self.fresh = min(c.max_fresh, self.fresh + c.fresh_step)

    def _speed_up(self) -> None:
        c = self.cfg
        if c.adjust != "updates" and self.fresh > c.min_fresh:
            self.fresh = max(c.min_fresh, self.fresh - c.fresh_step)
        elif c.adjust != "fresh" and self.updates < c.max_updates:
            self.updates = min(c.max_updates, self.updates + c.updates_step)

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "fresh": self.fresh,
            "sums": dict(self.sums),
            "count": self.count,
            "rewards": list(self.rewards),
            "streak": self.streak,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates = int(state["updates"])
        self.fresh = float(state["fresh"])
        self.sums = {k: float(v) for k, v in state.get("sums", {}).items()}
        self.count = int(state.get("count", 0))
        self.rewards = [float(r) for r in state.get("rewards", [])]
        self.streak = int(state.get("streak", 0))
