"""Group-relative advantages for GRPO-style training.

Every prompt is sampled ``group_size`` times; each completion's advantage is its reward relative
to the other samples of the same group (same ``group_id``):

* ``"grpo"``   -- ``(r - mean_g) / (std_g + eps)``; by default (``ddof=0``) with the *population*
  std, so a group of two rewards {0, 1} gets advantages of about -1/+1. ``ddof=1`` uses the
  sample std (verl's and TRL's ``torch.std`` convention): {0, 1} gives about -0.71/+0.71. The
  default stays 0 so existing runs and stores are reproduced bit for bit;
* ``"drgrpo"`` -- ``r - mean_g`` (Dr. GRPO drops the std normalisation, which otherwise
  up-weights groups whose rewards barely differ).

A group whose rewards are all equal gets exactly 0 in both modes. Rows may come in any order
and groups may interleave; everything is vectorised (``np.unique`` + ``np.bincount``).
Usage: ``adv = group_advantages(rewards, group_ids, mode="grpo")``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

AdvantageMode = Literal["grpo", "drgrpo"]
_MODES = ("grpo", "drgrpo")


def group_advantages(
    rewards: ArrayLike,
    group_ids: ArrayLike,
    *,
    mode: AdvantageMode = "grpo",
    eps: float = 1e-6,
    ddof: int = 0,
) -> np.ndarray:
    """Per-row group-normalised advantages as a float32 array shaped like ``rewards``.

    ``group_ids`` may hold any hashable-by-numpy values (ints, strings); rows with equal ids
    form a group. Statistics are computed in float64 and only the result is cast to float32.
    ``ddof``: 0 (population std, the default) or 1 (sample std); a one-row group is constant
    and gets 0 either way.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {list(_MODES)}")
    if ddof not in (0, 1) or isinstance(ddof, bool):
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std), got {ddof!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_ids)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if g.shape != r.shape:
        raise ValueError(f"group_ids shape {g.shape} does not match rewards shape {r.shape}")
    if r.size == 0:
        return np.zeros(0, dtype=np.float32)
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN or inf")

    _, inverse = np.unique(g, return_inverse=True)
    inverse = inverse.reshape(-1)
    counts = np.bincount(inverse)
    mean = np.bincount(inverse, weights=r) / counts
    centered = r - mean[inverse]
    # Exact zeros for constant groups: float sums of identical values can leave ~1e-17 residue.
    gmax = np.full(counts.size, -np.inf)
    gmin = np.full(counts.size, np.inf)
    np.maximum.at(gmax, inverse, r)
    np.minimum.at(gmin, inverse, r)
    centered[(gmax == gmin)[inverse]] = 0.0
    if mode == "drgrpo":
        return centered.astype(np.float32)
    # Groups of one row are constant (centered == 0): max(.., 1) only avoids 0 / 0.
    denom = counts if ddof == 0 else np.maximum(counts - ddof, 1)
    std = np.sqrt(np.bincount(inverse, weights=centered * centered) / denom)
    scale = std[inverse] + eps
    # A constant group with eps = 0 is 0 / 0: its advantages are exactly 0, as documented.
    out = np.divide(centered, scale, out=np.zeros_like(centered), where=scale > 0)
    return out.astype(np.float32)
