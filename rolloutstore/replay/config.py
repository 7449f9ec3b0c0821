"""``ReplayConfig``: what the replay buffer is (a view of the store) and how batches are drawn."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from rolloutstore.options import help_field as _h

# Columns a selection may read or filter on (``where`` may use any of them): the scalar
# ones, and of the multi-turn ones the derived counts and ``tools`` (a short list<string>
# of tool names, for DuckDB list functions such as ``list_contains(tools, ?)``); never the
# per-token lists or ``turns``.
SCALAR_COLUMNS = [
    "rollout_id", "run_id", "prompt_id", "group_id", "sample_index", "policy_version",
    "policy_id", "tokenizer_fingerprint", "finish_reason", "temperature", "top_p", "top_k",
    "max_tokens", "seed", "logprobs_mode", "generator", "reward", "advantage", "created_at",
    "num_prompt_tokens", "num_completion_tokens", "task", "num_turns", "num_model_tokens",
    "num_tool_calls", "tools",
]  # fmt: skip

# Columns a ``where`` may name: the scanned ones plus the overlaid ``reward_version``.
WHERE_COLUMNS = [*SCALAR_COLUMNS, "reward_version"]

# What selection itself reads when no `where` names other columns.
SELECT_COLUMNS = [
    "rollout_id", "run_id", "prompt_id", "group_id", "policy_version", "created_at", "reward",
    "advantage", "num_prompt_tokens", "num_completion_tokens",
]  # fmt: skip

Priority = Literal["uniform", "advantage"]
Diversity = Literal["none", "prompt", "embedding"]

PRIORITIES = ("uniform", "advantage")
DIVERSITIES = ("none", "prompt", "embedding")


@dataclass(frozen=True)
class ReplayConfig:
    """The replay buffer as a view of the append-only store, plus the sampling rule.

    Order of operations for one batch: eligible rows (``runs``, ``where``) -> the
    ``window`` most recent of them by (policy_version, created_at, rollout_id) ->
    ``max_staleness`` -> ``max_uses`` -> ``drop_zero_variance_groups`` -> sampling
    (``positive_fraction``, ``priority``, ``diversity``, ``per_prompt_cap``,
    ``whole_groups``, ``replacement``).
    """

    window: int | None = _h("FIFO capacity N: only the N most recent eligible rollouts", None)
    max_staleness: int | None = _h("only rows with policy_version >= learner_version - k", None)
    max_uses: int | None = _h("reuse cap: rows used this many times are not drawn again", None)
    replacement: bool = _h("allow the same rollout twice within one batch", False)
    per_prompt_cap: int | None = _h("at most this many rollouts of one prompt per batch", None)
    whole_groups: bool = _h("draw complete GRPO groups (batch size rounds to groups)", False)
    drop_zero_variance_groups: bool = _h(
        "skip groups whose rewards are all equal (no GRPO signal)", False
    )
    positive_fraction: float = _h(
        "share of each batch drawn from the freshest rollouts with reward > threshold", 0.0
    )
    positive_threshold: float = _h("reward above which a rollout counts as positive", 0.0)
    positive_pool: int = _h("how many freshest positives form the positive pool", 1024)
    fresh_fraction: float = _h(
        "share of each batch drawn from the newest policy version(s) in the buffer", 0.0
    )
    fresh_versions: int = _h("how many newest policy versions count as fresh", 1)
    reward_version: int | None = _h(
        "re-scoring to read rewards/advantages from (None: each rollout's newest)", None
    )
    priority: Priority = _h("uniform, or advantage: P ~ |A|^alpha", "uniform")
    alpha: float = _h("priority exponent for priority=advantage", 1.0)
    beta: float = _h("importance-weight exponent: w ~ (N P)^-beta, normalised by max", 0.4)
    priority_eps: float = _h("added to |A| so zero-advantage rows keep some mass", 1e-3)
    diversity: Diversity = _h(
        "none; prompt: spread over prompts; embedding: farthest-point cover of a pool", "none"
    )
    diversity_pool: int = _h("candidate pool size (x batch size) for embedding diversity", 8)
    runs: tuple[str, ...] | None = _h("eligible run_ids (None: all runs)", None)
    where: str | None = _h("extra SQL filter over scalar columns, with ? placeholders", None)
    where_params: tuple = _h("values for the ? placeholders of where", ())
    seed: int | None = _h("sampling seed (None: 0; in a rolloutstore-train run, [run].seed)", None)

    def __post_init__(self) -> None:
        for name in ("window", "max_uses", "per_prompt_cap"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ReplayConfig.{name} must be a positive int or None, got {v!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
        ):
            raise ValueError(f"ReplayConfig.seed must be an int or None, got {self.seed!r}")
        if self.max_staleness is not None and (
            not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ValueError(f"ReplayConfig.max_staleness must be >= 0, got {self.max_staleness!r}")
        if not 0.0 <= self.positive_fraction <= 1.0:
            raise ValueError(
                f"ReplayConfig.positive_fraction must be in [0, 1], got {self.positive_fraction}"
            )
        if not 0.0 <= self.fresh_fraction <= 1.0:
            raise ValueError(
                f"ReplayConfig.fresh_fraction must be in [0, 1], got {self.fresh_fraction}"
            )
        if not isinstance(self.fresh_versions, int) or self.fresh_versions < 1:
            raise ValueError(
                f"ReplayConfig.fresh_versions must be a positive int, got {self.fresh_versions!r}"
            )
        if self.reward_version is not None and (
            not isinstance(self.reward_version, int) or self.reward_version < 0
        ):
            raise ValueError(
                f"ReplayConfig.reward_version must be an int >= 0 or None, got {self.reward_version!r}"
            )
        if self.priority not in PRIORITIES:
            raise ValueError(
                f"ReplayConfig.priority must be one of {PRIORITIES}, got {self.priority!r}"
            )
        if self.diversity not in DIVERSITIES:
            raise ValueError(
                f"ReplayConfig.diversity must be one of {DIVERSITIES}, got {self.diversity!r}"
            )
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"ReplayConfig alpha/beta must be >= 0, got {self.alpha}, {self.beta}")
        if self.positive_pool < 1 or self.diversity_pool < 1:
            raise ValueError("ReplayConfig.positive_pool and diversity_pool must be >= 1")
        # Normalise sequences so configs compare and hash equal however they were built.
        if self.runs is not None:
            object.__setattr__(self, "runs", tuple(self.runs))
        object.__setattr__(self, "where_params", tuple(self.where_params))
        if self.where is not None:
            _check_where(self.where, len(self.where_params))
        elif self.where_params:
            raise ValueError(
                f"ReplayConfig.where_params {self.where_params!r} given without a where to bind"
            )

    def seeded(self) -> ReplayConfig:
        """This config with an unset ``seed`` as 0, the seed the selector draws with."""
        return self if self.seed is not None else dataclasses.replace(self, seed=0)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["runs"] = list(self.runs) if self.runs is not None else None
        d["where_params"] = list(self.where_params)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ReplayConfig keys {unknown}; known: {sorted(known)}")
        d = dict(d)
        if d.get("runs") is not None:
            d["runs"] = tuple(d["runs"])
        if "where_params" in d:
            d["where_params"] = tuple(d["where_params"])
        return cls(**d)


def _check_where(where: str, n_params: int) -> None:
    """``where`` is spliced into a WHERE clause: the one validator in ``sql`` decides."""
    from rolloutstore.query.sql import check_where

    check_where(where, WHERE_COLUMNS, what="ReplayConfig.where", n_params=n_params)
