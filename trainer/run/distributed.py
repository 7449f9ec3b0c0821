"""Distributed learners under ``torchrun``: the process group, DDP, and rank-0-only side effects.

    torchrun --nproc-per-node 2 -m trainer train examples/arith.toml
    torchrun --nproc-per-node 2 -m trainer resume runs/arith     # the same number of ranks

Sync mode only. Every rank builds the same model from the same seed (DDP broadcasts rank 0's
weights at wrap time anyway, so they start equal by construction). Rank 0 is the store's one
writer: it generates each round and appends it, records usage, and alone writes metrics,
checkpoints and published weights; the other ranks wait at a barrier after each round, then all
ranks draw from the same store version. ``run.batch_size`` is the *global* batch: the selector
draws one selection per step (a pure function of seed, step and store) and rank ``r`` of ``W``
trains on rows ``r::W`` of it (:class:`rolloutstore.replay.ReplayDataset`). The learner
normalises by the global token count and DDP *sums* the gradients, so one step equals the
single-process step on the whole selection up to float summation order; on CPU (gloo) the
all-reduce of two ranks is one addition per element, so a run is bit-for-bit repeatable and a
resumed run equals the uninterrupted one.

Backends: gloo on CPU, NCCL when CUDA is available (one GPU per rank, ``cuda:LOCAL_RANK``).

FSDP (``[run] fsdp = true``, torchrun only): instead of DDP, :func:`shard_learner` applies
torch's FSDP2 ``fully_shard`` to each decoder layer and then to the :class:`LogProbModule` root,
so each rank holds 1/W of the weights, gradients and AdamW moments. The gradient is
reduce-scattered as a plain *sum* (divide factor 1), the same semantics as DDP's hook, and the
grad norm is the global one (the shards' squares all-reduced), so a step equals the DDP step up to
float rounding of the norm. Whatever needs the full weights — the generator sync, checkpoints,
published weights, the rank trace — gathers them with a collective that every rank calls
(:meth:`trainer.algo.learner.Learner.full_weights`, :meth:`~trainer.algo.learner.Learner.state_dict`);
rank 0 receives them and alone writes. A resume loads the full checkpoint on every rank and
re-shards it (the same number of ranks, and the same ``run.fsdp``, as the run that wrote it).
There are no replicas to compare, so the replica check is skipped.

Tests and debugging: ``ROLLOUTSTORE_RANK_TRACE=DIR`` makes every rank append, per step, the
rollout ids it trained on and a digest of its weights to ``DIR/rank-R.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.algo.logprobs import sequence_logprobs

__all__ = [
    "Dist",
    "LogProbModule",
    "from_env",
    "shard_learner",
    "weights_digest",
    "wrap_learner",
]


@dataclass(frozen=True)
class Dist:
    """This process's place among the learner ranks (one rank, no process group, by default)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # A single process: CUDA when available (as [model].device = "auto"), else the CPU.
    device: torch.device = field(
        default_factory=lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (on every rank)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def check_replicas(self, model: torch.nn.Module) -> str:
        """The weights' digest; raises if any rank's weights differ from rank 0's."""
        digest = weights_digest(model)
        digests = self.gather(digest)
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise RuntimeError(
                f"learner ranks {bad} hold different weights than rank 0 "
                f"({[d[:12] for d in digests]}); the replicas diverged, so the run is stopped "
                "before it checkpoints (resume from the previous checkpoint)"
            )
        return digest

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def from_env() -> Dist:
    """Join the process group that ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK).

    Without those variables (or with WORLD_SIZE=1) this is a single process and nothing is
    initialised.
    """
    world = _env_int("WORLD_SIZE")
    if world is None or world == 1:
        return Dist()
    rank, local = _env_int("RANK"), _env_int("LOCAL_RANK")
    if rank is None or not 0 <= rank < world:
        raise ValueError(
            f"WORLD_SIZE={world} but RANK={os.environ.get('RANK')!r}: start distributed "
            "learners with `torchrun --nproc-per-node N -m trainer ...`"
        )
    local = rank if local is None else local
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    return Dist(rank=rank, world_size=world, local_rank=local, device=device)


class LogProbModule(torch.nn.Module):
    """The learner's forward (:func:`trainer.algo.logprobs.sequence_logprobs`) as a module DDP wraps.

    The learner scores tokens through the base transformer and a chunked LM head, never
    ``model(...)``; DDP only all-reduces gradients of a forward that ran through its wrapper.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, **kwargs: Any):
        out = sequence_logprobs(self.model, input_ids, **kwargs)
        return out.logprobs, out.entropy


def _sum_hook(process_group, bucket):
    # The learner already normalises each rank's loss by the global token count, so the
    # ranks' gradients add up to the global one: sum, do not average.
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_learner(learner: Any, d: Dist) -> None:
    """Give ``learner`` a DDP wrapper of its model (no-op on a single process).

    Call after the weights are final (warm start, checkpoint restore): DDP broadcasts rank 0's
    parameters to every rank here.
    """
    if not d.enabled:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        LogProbModule(learner.model),
        device_ids=[d.local_rank] if d.device.type == "cuda" else None,
        forward_sync_buffers=False,  # no trained buffers (rotary tables are recomputed)
    )
    ddp.register_comm_hook(None, _sum_hook)
    learner.ddp = ddp


def shard_learner(learner: Any, d: Dist) -> None:
    """Shard ``learner``'s model with FSDP2 across the ranks (``[run] fsdp``).

    ``fully_shard`` each decoder layer, then the :class:`LogProbModule` root (embeddings, final
    norm, LM head). Call right after building the learner with the initial weights (equal on
    every rank: same seed and warm start), *before* restoring a checkpoint: sharding replaces
    the parameters, so the optimizer is rebuilt here, and a restore then re-shards the full
    checkpoint through :meth:`trainer.algo.learner.Learner.load_state_dict`.
    """
    if not d.enabled:
        raise ValueError(
            "run.fsdp = true shards the learner across torchrun ranks; start with "
            "`torchrun --nproc-per-node N -m trainer ...` or set run.fsdp = false"
        )
    from torch.distributed.fsdp import fully_shard

    root = LogProbModule(learner.model)
    layers = getattr(getattr(learner.model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"run.fsdp = true needs a decoder with model.model.layers, got "
            f"{type(learner.model).__name__}; set run.fsdp = false to use DDP"
        )
    # fully_shard keeps each rank's slice of its own copy: start every copy from rank 0's.
    for t in learner.model.state_dict().values():
        dist.broadcast(t, src=0)
    # Kept gathered between forward and backward (and across micro-batches until the last
    # backward, see Learner.step): ranks with different micro-batch counts then still issue
    # the same collectives.
    for layer in layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(root, reshard_after_forward=False)
    # The learner normalises by the global token count: sum the ranks' gradients, as DDP does.
    # (Per FSDP module: the setters do not recurse, and the layers would otherwise average.)
    for module in (*layers, root):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    learner.ddp, learner.sharded = root, True
    learner.build_optimizer()


def weights_digest(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the state dict: names in sorted order, each followed by its raw float bits."""
    h = hashlib.sha256()
    state = model if isinstance(model, Mapping) else model.state_dict()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_view(d: Dist, batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """The per-sequence values metrics need, over the global batch (every rank's share)."""
    mine = {
        "rewards": batch["rewards"].numpy(),
        "staleness": batch["staleness"].numpy(),
        "run_ids": np.asarray(batch["run_ids"], dtype=object),
    }
    parts = d.gather(mine)
    return {k: np.concatenate([p[k] for p in parts]) for k in mine}


def trace(d: Dist, step: int, batch: dict[str, Any], learner: Any) -> None:
    """Append this rank's draw and weights digest at ``step`` under ROLLOUTSTORE_RANK_TRACE.

    Sharded learners digest the gathered full weights (a collective: the variable must be set
    for every rank, as torchrun passes it on).
    """
    folder = os.environ.get("ROLLOUTSTORE_RANK_TRACE")
    if not folder:
        return
    weights = learner.full_weights(all_ranks=True)
    rec = {
        "step": step,
        "rank": d.rank,
        "world_size": d.world_size,
        "rollout_ids": list(batch["rollout_ids"]),
        "weights_sha256": weights_digest(weights),
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"rank-{d.rank}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
