"""``[run.ray]``: where and how the Ray launcher places the actors (``[run] launcher = "ray"``).

A plain dataclass (no Ray import): the config loads, validates and prints on machines
without Ray; only :class:`trainer.run.ray_actors.RayActorPool` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolloutstore.options import help_field as _h

PLACEMENTS = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """[run.ray]: the Ray cluster and each actor's resources (launcher = "ray")."""

    address: str = _h(
        'Ray cluster to join ("auto", "HOST:PORT", "ray://HOST:10001"); empty: start a local '
        "one in the learner's process tree (stopped with the learner)",
        "",
    )
    local_cpus: int = _h("CPUs of a local cluster Ray starts (0: all cores)", 0)
    num_cpus: float = _h(
        "CPUs each actor reserves; keep it small (Ray Data tasks of an export need whole "
        "CPUs: actors holding them all hang the export); the threads it runs: [run] threads",
        0.1,
    )
    num_gpus: float = _h("GPUs each actor reserves (a vLLM actor on a GPU node: 1)", 0.0)
    resources: dict = _h(
        "custom resources each actor needs, e.g. {rollout_node = 1} to keep actors off nodes "
        "without that label",
        {},
    )
    placement: str = _h(
        'a placement group with one bundle per actor: "PACK", "SPREAD", "STRICT_PACK", '
        '"STRICT_SPREAD" (empty: none, Ray places each actor)',
        "",
    )
    max_restarts: int = _h(
        "times Ray restarts a dead actor (its process or node lost); each restart resumes the "
        "actor's next round from beside the weights",
        5,
    )

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for key in ("num_cpus", "num_gpus", "max_restarts", "local_cpus"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not isinstance(self.resources, dict) or not all(
            isinstance(v, int | float) and v >= 0 for v in self.resources.values()
        ):
            raise ValueError(f"resources must map names to amounts >= 0, got {self.resources!r}")

    @classmethod
    def from_table(cls, value: Any) -> RayConfig:
        """A [run.ray] table (dict, e.g. from a run.json) or an instance, as an instance."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"must be a table, got {type(value).__name__}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown key(s) {sorted(unknown)}; known keys: "
                f"{', '.join(sorted(cls.__dataclass_fields__))}"
            )
        return cls(**value)
