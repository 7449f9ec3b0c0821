"""The learner: one optimizer step of an off-policy policy-gradient loss on a replay batch.

``Learner.step(batch)`` takes one item of :class:`rolloutstore.replay.ReplayDataset` — a padded
or packed batch dict, or the list of micro-batch dicts the loader yields when it was built with
``micro_batch_tokens`` — and does, in order:

1. split the batch into micro-batches of at most ``OptimConfig.micro_batch_tokens`` tokens
   (a single dict only; padded batches split along sequences, packed ones along ``cu_seqlens``);
2. per micro-batch: the model's per-token log-probs under each row's stored sampling processing
   (``temperature``, ``top_k``, ``top_p``; :mod:`trainer.algo.behavior`, which also refuses rows
   it cannot reproduce) with :func:`trainer.algo.logprobs.sequence_logprobs`, the
   configured :func:`trainer.algo.loss.policy_loss` normalised by the token / sequence count of the
   *whole* step, and ``backward`` — so the accumulated gradient equals one big batch's;
3. clip the global grad norm, AdamW step, LR schedule step, ``policy_version += 1``.

PPO epochs (``OptimConfig.ppo_epochs`` x ``mini_batches`` > 1, single learner only;
``Learner._ppo_updates``, its plan and helpers in :mod:`trainer.algo.epochs`): the drawn batch
is scored once with the current weights (pi_old), then each of its mini-batches is one optimizer
step (steps 2 and 3 without the schedule), for ``ppo_epochs`` passes; ``policy_version``,
``steps_done`` and the LR schedule advance once per *drawn batch*.

Distributed (``trainer.run.distributed``): with ``learner.ddp`` set to a DDP-wrapped
:class:`trainer.run.distributed.LogProbModule` of the model, each rank steps on its share of the
global batch; the step's token / sequence totals are summed over ranks so that every rank
normalises by the *global* batch, the gradient is all-reduced (summed) once per step on the
last micro-batch, and the metrics are reduced over ranks, so all ranks take the same step.
With ``learner.sharded`` (``[run] fsdp``, :func:`trainer.run.distributed.shard_learner`) the wrapper
is an FSDP2 module instead: the same step, but each rank holds and updates a shard of the
weights, gradients and AdamW moments; :meth:`Learner.state_dict` and
:meth:`Learner.full_weights` then gather (collectives: call them on every rank;
:mod:`trainer.algo.learner_state` does it on the learner's model, optimizer and wrapper).

Packed micro-batches are scored as one row (the model isolates the packed sequences through the
restarting ``position_ids``) and the per-token results are then scattered into a per-sequence
``(n, L-1)`` grid, so per-sequence quantities (``weights``, ``staleness``, GSPO's sequence ratio,
the ``seq-mean-*`` aggregations) mean the same as for a padded batch.

pi_prox (``decoupled``; ``tis`` / ``icepop`` use the same quantity) is the policy at the start of
this learner step. With one optimizer step per batch (the default) the weights of the gradient
forward *are* pi_prox and its detached log-probs are exactly what a separate no-grad forward would
return; the learner uses them instead of paying for a second forward. With PPO epochs it is the
scored pi_old above.

Usage::

    learner = Learner(model, LossConfig(loss_type="ppo"), OptimConfig(lr=1e-6, total_steps=500))
    ds = ReplayDataset(store, cfg, batch_size=64, learner_version=lambda s: learner.policy_version)
    for batch in ds:
        metrics = learner.step(batch)

Tests: ``python -m pytest -q tests/trainer/test_learner.py``.
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trainer.algo import learner_state
from trainer.algo.batching import (
    check_lengths,
    is_packed,
    num_sequences,
    split_packed,
    split_padded,
    unpack_index,
)
from trainer.algo.behavior import batch_rows, check_logprobs_modes, sampling_kwargs
from trainer.algo.epochs import (
    mean_updates,
    mini_batch_plan,
    old_logprob_grids,
    pieces,
    sequence_offsets,
)
from trainer.algo.logprobs import packed_target_mask, sequence_logprobs
from trainer.algo.loss import LossConfig, policy_loss
from trainer.algo.loss_config import MAX_METRICS
from trainer.algo.optim import OptimConfig, apply_optim_config, build_adamw

__all__ = ["Learner", "MicroBatchBudgetWarning"]


class MicroBatchBudgetWarning(UserWarning):
    """Sequences longer than ``micro_batch_tokens`` were trained alone, over the budget."""


class Learner:
    """Owns the model, its AdamW optimizer and LR schedule, and the policy version.

    Args:
        model: a HuggingFace causal LM with ``model.model`` and a plain ``model.lm_head``.
        loss_cfg: which policy loss (see :mod:`trainer.algo.loss`).
        optim_cfg: optimizer, schedule and micro-batching.
        device: where the model and batches live.
        compute_dtype: the precision the model runs in: float32 (no autocast), or bfloat16 /
            float16 (autocast on ``device``; the weights stay as given, float32 master weights in
            the trainer). None: bfloat16 autocast on CUDA, float32 on CPU. The LM head and the
            softmax of the log-probs run in float32 regardless (trainer.algo.logprobs).
        temperature, top_k, top_p: the generator's sampling processing, used for rows whose
            batch carries no per-row settings (each row is scored under its own stored ones).
        chunk_size: rows per LM-head chunk in the log-prob computation.
        ref_model: frozen reference model for the k3 KL penalty (required when
            ``loss_cfg.kl_coef > 0``).
        compute_entropy: also compute per-token entropies (always on when
            ``loss_cfg.entropy_coef > 0``) and report their mean.
        gradient_checkpointing: recompute activations in backward (HF models; less memory,
            slower steps); a run sets it from ``[model].gradient_checkpointing``.
    """

    def __init__(
        self,
        model: Any,
        loss_cfg: LossConfig,
        optim_cfg: OptimConfig,
        *,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        chunk_size: int = 1024,
        ref_model: Any | None = None,
        compute_entropy: bool = False,
        gradient_checkpointing: bool = False,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if loss_cfg.agg == "seq-mean-token-sum-norm" and loss_cfg.agg_norm_len is None:
            raise ValueError(
                "loss_cfg.agg = 'seq-mean-token-sum-norm' needs agg_norm_len (e.g. the "
                "generation's max_tokens; the training loops fill it in from [generation])"
            )
        if loss_cfg.kl_coef > 0 and ref_model is None:
            raise ValueError(f"loss_cfg.kl_coef={loss_cfg.kl_coef} requires ref_model")
        self.loss_cfg = loss_cfg
        self.optim_cfg = optim_cfg.seeded()
        self.device = torch.device(device)
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.compute_dtype = compute_dtype
        self.temperature = float(temperature)
        self.top_k, self.top_p, self.chunk_size = top_k, top_p, chunk_size
        self.compute_entropy = compute_entropy or loss_cfg.entropy_coef > 0
        self.policy_version = 0
        self.steps_done = 0
        self.rows_over_micro_budget = 0  # of the last step (see _check_lengths)
        self._warned_micro_budget = False
        self.update_metrics: list[dict[str, float]] = []  # per optimizer step of the last step
        # A DDP-wrapped (or, with `sharded`, fully_shard-ed) trainer.run.distributed.LogProbModule
        # of self.model (set by wrap_learner / shard_learner).
        self.ddp: Any | None = None
        self.sharded = False

        torch.manual_seed(self.optim_cfg.seed)
        self.model = model.to(self.device)
        self.model.train()
        if gradient_checkpointing:
            # Non-reentrant checkpointing works with inputs that do not require grad.
            # transformers >= 5.x renamed the API; the old name warns there.
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.ref_model = ref_model.to(self.device).eval() if ref_model is not None else None

        self.build_optimizer()

    def build_optimizer(self) -> None:
        """A fresh AdamW and LR schedule over the model's current parameters.

        FSDP replaces the parameters with sharded ones: :func:`trainer.run.distributed.shard_learner`
        calls this again after sharding (before any step or checkpoint restore).
        """
        self.params, self.optimizer, self.scheduler = build_adamw(self.model, self.optim_cfg)

    # -- public API ------------------------------------------------------------------------
    def step(self, batch: dict[str, Any] | list[dict[str, Any]]) -> dict[str, float]:
        """One learner step on one replay item; returns plain-float metrics.

        By default (``OptimConfig.ppo_epochs = mini_batches = 1``) one optimizer step on the
        whole item. Otherwise (:meth:`_ppo_updates`) ``ppo_epochs * mini_batches`` optimizer
        steps on mini-batches of it, and the metrics are means over those updates
        (``is_weight_max`` / ``ratio_max_dev`` maxima, ``skipped`` a count); the per-update
        metrics are kept in ``self.update_metrics``.

        Metrics: ``loss`` and every :class:`trainer.algo.loss.LossOutput` diagnostic (token-weighted
        means over micro-batches; ``is_weight_max`` and ``ratio_max_dev`` their max; ``ess_frac``
        is the token-weighted mean of the micro-batches' ESS fractions), ``grad_norm`` (before
        clipping), ``lr`` (used for this step), ``tokens`` (loss tokens), ``sequences``,
        ``micro_batches``, ``rows_over_micro_budget`` (sequences longer than ``micro_batch_tokens``,
        each trained alone), ``optimizer_steps`` (updates applied), ``policy_version`` (after the
        step), ``staleness`` (mean), ``skipped`` (1 when the gradient was not finite and no
        update was made), ``seconds``.
        """
        t0 = time.perf_counter()
        check_logprobs_modes(batch_rows(batch), f"learner step {self.steps_done}")
        mbs, tokens, seqs = self._micro_batches(batch)
        oc = self.optim_cfg
        if oc.ppo_epochs * oc.mini_batches == 1:
            sums, staleness_sum = self._accumulate(mbs, tokens, seqs)
            grad_norm, lr, skipped = self._update()
            updates = [{**sums, "grad_norm": grad_norm, "skipped": float(skipped)}]
        else:
            updates, staleness_sum, lr = self._ppo_updates(mbs)
        self.update_metrics = updates
        applied = sum(u["skipped"] == 0.0 for u in updates)
        if applied:
            # The LR schedule and policy_version count learner steps (drawn batches).
            self.scheduler.step()
            self.policy_version += 1
            self.steps_done += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so `seconds` measures the work, not launches

        sums = updates[0] if len(updates) == 1 else mean_updates(updates)
        sums.update(
            lr=float(lr),
            tokens=float(tokens),
            sequences=float(seqs),
            micro_batches=float(len(mbs)),
            rows_over_micro_budget=float(self.rows_over_micro_budget),
            optimizer_steps=float(applied),
            policy_version=float(self.policy_version),
            staleness=staleness_sum / max(seqs, 1),
            seconds=time.perf_counter() - t0,
        )
        return sums if self.ddp is None else self._reduce_metrics(sums)

    def _accumulate(
        self, mbs: list[dict[str, Any]], tokens: int, seqs: int
    ) -> tuple[dict[str, float], float]:
        """Forward + backward of every micro-batch into fresh gradients; (metrics, staleness sum)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        maxes = dict.fromkeys(MAX_METRICS, 0.0)
        staleness_sum = 0.0
        for i, mb in enumerate(mbs):
            mb = self._to_device(mb)
            # DDP: all-reduce the accumulated gradient once, on the last micro-batch.
            last = i == len(mbs) - 1
            if self.sharded:
                # Ranks may split into different numbers of micro-batches: keep the weights
                # gathered until the last backward, so every rank runs the same collectives
                # (one all-gather per layer, then one reduce-scatter per layer).
                self.ddp.set_requires_gradient_sync(last)
                self.ddp.set_reshard_after_backward(last)
            sync = nullcontext() if self.ddp is None or last or self.sharded else self.ddp.no_sync()
            with sync:
                out, n_tok = self._forward_backward(mb, tokens, seqs)
            m = out.metrics()
            for k in MAX_METRICS:
                maxes[k] = max(maxes[k], m.pop(k))
            m.pop("mean_staleness", None)
            staleness_sum += float(mb["staleness"].double().sum())
            for k, v in m.items():
                # loss / pg_loss are already globally normalised: they add up to the step's.
                w = 1.0 if k in ("loss", "pg_loss") else n_tok / max(tokens, 1)
                sums[k] = sums.get(k, 0.0) + w * v
        sums.update(maxes)
        return sums, staleness_sum

    def _update(self) -> tuple[float, float, bool]:
        """Clip and apply the accumulated gradient: (grad_norm, lr, skipped)."""
        grad_norm = float(self._clip_grad_norm())
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            # A nan/inf gradient would poison AdamW's moments for good; drop the step instead.
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        return grad_norm, lr, skipped

    def _ppo_updates(self, mbs: list[dict[str, Any]]) -> tuple[list[dict], float, float]:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps over one drawn batch.

        pi_old: before the first update every sequence is scored once with the current weights
        (eval mode, no grad), on exactly the tensors of the first epoch's mini-batches, so the
        first mini-batch's ratio pi_theta / pi_old is exactly 1; tis / icepop / decoupled use
        these log-probs as ``prox_logp``. The sequences of a pass are split by a permutation
        drawn from ``(seed, steps_done, epoch)``, so a resumed learner repeats the order.

        Returns (per-update metrics, staleness sum, the last update's lr).
        """
        if self.ddp is not None:
            raise ValueError(
                "[optim] ppo_epochs / mini_batches > 1 are single-learner for now (ranks would "
                "need equal mini-batches); under torchrun keep them at 1"
            )
        oc = self.optim_cfg
        offsets = sequence_offsets(mbs)
        n_seqs = int(offsets[-1])
        plans = [
            mini_batch_plan(oc.seed, self.steps_done, e, n_seqs, oc.mini_batches)
            for e in range(oc.ppo_epochs)
        ]
        mbs = self._with_old_logprobs(mbs, offsets, plans[0])
        updates, staleness_sum, lr = [], 0.0, 0.0
        for plan in plans:
            for part in plan:
                subs = pieces(mbs, offsets, part)
                tokens = sum(int(self._target_mask(mb).sum()) for mb in subs)
                sums, stal = self._accumulate(subs, tokens, len(part))
                grad_norm, lr, skipped = self._update()
                updates.append({**sums, "grad_norm": grad_norm, "skipped": float(skipped)})
                staleness_sum += stal / oc.ppo_epochs  # every sequence once per epoch
        return updates, staleness_sum, lr

    @torch.no_grad()
    def _with_old_logprobs(
        self, mbs: list[dict[str, Any]], offsets: np.ndarray, plan: list[np.ndarray]
    ) -> list[dict[str, Any]]:
        """The micro-batches with an ``old_logprobs`` ``(n, L-1)`` grid of the current weights."""
        grids = old_logprob_grids(mbs)
        was_training = self.model.training
        self.model.eval()
        try:
            # Scored on the first epoch's pieces: the tensors its first update will see.
            for part in plan:
                for i, local, sub in pieces(mbs, offsets, part, with_index=True):
                    with self._autocast():
                        logp = self._logprobs(self.model, self._to_device(sub), entropy=False)[0]
                    grids[i][torch.from_numpy(local), : logp.shape[1]] = logp.float().cpu()
        finally:
            self.model.train(was_training)
        return [{**mb, "old_logprobs": g} for mb, g in zip(mbs, grids)]

    def _clip_grad_norm(self) -> Tensor:
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip else math.inf
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        # Sharded (DTensor) gradients: each rank's norm is a partial; full_tensor() all-reduces
        # the squares into the global norm, and every rank clips its shard by it.
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return norm

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-rank partial metrics -> the global batch's (all ranks get the same values)."""
        import torch.distributed as dist

        # Equal on every rank already: computed from the all-reduced gradient or totals.
        same = {
            "grad_norm",
            "lr",
            "tokens",
            "sequences",
            "policy_version",
            "skipped",
            "optimizer_steps",
        }
        top = [*MAX_METRICS, "seconds"]
        # The rest are partial sums: loss terms are normalised by the global totals, the
        # diagnostics weighted by n_tok / global tokens, staleness divided by global sequences.
        keys = sorted(k for k in sums if k not in same and k not in top)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        m = torch.tensor([sums[k] for k in top], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return {**sums, **dict(zip(keys, t.tolist())), **dict(zip(top, m.tolist()))}

    @torch.no_grad()
    def sequence_logprobs(self, batch: dict[str, Any]) -> Tensor:
        """Current ``(B, T-1)`` log-probs of a padded batch's target tokens (no grad)."""
        b = self._to_device(batch)
        with self._autocast():
            return self._logprobs(self.model, b, entropy=False)[0]

    def full_weights(self, *, all_ranks: bool = False) -> dict[str, Tensor]:
        """The model's full (unsharded) state dict, on CPU when sharded; with LoRA adapters the
        merged weights under the base names (what generators load; trainer/models/lora.py).

        Sharded, this is a collective: every rank must call it; rank 0 gets the tensors, the
        others ``{}`` unless ``all_ranks``.
        """
        return learner_state.full_weights(
            self.model, self.ddp, sharded=self.sharded, all_ranks=all_ranks
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: weights, AdamW, schedule, version, RNG.

        Sharded: a collective; rank 0 gets the full weights and optimizer state, the other
        ranks empty ones (only rank 0 writes checkpoints).
        """
        model, optim = learner_state.gather_state(
            self.model, self.optimizer, self.ddp, sharded=self.sharded
        )
        return {
            "model": model,
            "optimizer": optim,
            "sharded": self.sharded,
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy_version,
            "steps_done": self.steps_done,
            **learner_state.rng_state(self.device),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (sharded: from the full state, on every rank); this
        learner's ``optim_cfg`` lr, weight decay, betas and eps win over the saved ones."""
        learner_state.restore_state(
            self.model, self.optimizer, self.ddp, state, sharded=self.sharded
        )
        self.scheduler.load_state_dict(state["scheduler"])
        # The learner's own [optim] wins over the saved hyperparameters (a resume may change lr).
        apply_optim_config(self.optimizer, self.scheduler, self.optim_cfg)
        self.policy_version = int(state["policy_version"])
        self.steps_done = int(state["steps_done"])
        learner_state.restore_rng(state, self.device)

    # -- internals -------------------------------------------------------------------------
    def _micro_batches(
        self, batch: dict[str, Any] | list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int, int]:
        """(micro-batches, loss tokens of the step, sequences of the step)."""
        self._check_lengths([batch] if isinstance(batch, dict) else list(batch))
        if isinstance(batch, dict):
            mbs = [batch]
            budget = self.optim_cfg.micro_batch_tokens
            if budget is not None and int(batch["attention_mask"].sum()) > budget:
                split = split_packed if is_packed(batch) else split_padded
                mbs = split(batch, budget)
        else:
            mbs = list(batch)
            if not mbs:
                raise ValueError("Learner.step got an empty list of micro-batches")
        tokens = sum(int(self._target_mask(mb).sum()) for mb in mbs)
        seqs = sum(num_sequences(mb) for mb in mbs)
        # The loader's totals win when present (read from the batch itself: a split drops them).
        first = batch if isinstance(batch, dict) else mbs[0]
        tokens = int(first.get("step_loss_tokens", tokens))
        seqs = int(first.get("step_sequences", seqs))
        if self.ddp is not None:
            # This rank's totals -> the global batch's, so every rank normalises by it.
            import torch.distributed as dist

            t = torch.tensor([tokens, seqs], dtype=torch.int64, device=self.device)
            dist.all_reduce(t)
            tokens, seqs = (int(v) for v in t.tolist())
        return mbs, tokens, seqs

    def _check_lengths(self, items: list[dict[str, Any]]) -> None:
        """Count (``rows_over_micro_budget``) and warn once of sequences longer than
        ``micro_batch_tokens``; refuse one longer than the model's positions."""
        budget = self.optim_cfg.micro_batch_tokens
        config = getattr(self.model, "config", None)
        positions = getattr(config, "max_position_embeddings", None)
        over, longest = check_lengths(items, budget, positions)
        self.rows_over_micro_budget = over
        if over and not self._warned_micro_budget:
            self._warned_micro_budget = True
            warnings.warn(
                f"learner step {self.steps_done}: {over} sequence(s) longer than "
                f"[optim].micro_batch_tokens = {budget} (longest {longest} tokens) are trained "
                "alone, each in a micro-batch that exceeds the budget; train records count "
                "them as rows_over_micro_budget (warned once): raise micro_batch_tokens, or "
                f"keep such rows out with [run].max_tokens_per_batch <= {budget}",
                MicroBatchBudgetWarning,
                stacklevel=4,
            )

    @staticmethod
    def _target_mask(mb: dict[str, Any]) -> Tensor:
        mask = mb["loss_mask"] > 0
        if is_packed(mb):
            mask = mask & packed_target_mask(mb["position_ids"])
        return mask

    def _to_device(self, mb: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in mb.items()
        }

    def _autocast(self):
        if self.compute_dtype in (torch.bfloat16, torch.float16):
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return nullcontext()

    def _logprobs(self, model: Any, mb: dict[str, Any], entropy: bool):
        """Per-token log-probs (and entropies) in the per-sequence ``(n, L-1)`` layout."""
        packed = is_packed(mb)
        kwargs = dict(
            # Packed rows rely on the restarting position ids for isolation (see logprobs.py).
            attention_mask=None if packed else mb["attention_mask"],
            position_ids=mb["position_ids"],
            chunk_size=self.chunk_size,
            return_entropy=entropy,
            # Without an entropy bonus the entropy is only reported: no gradient to build.
            entropy_grad=self.loss_cfg.entropy_coef > 0,
            **sampling_kwargs(mb, (self.temperature, self.top_k, self.top_p), self.device),
        )
        if (
            self.ddp is not None
            and model is self.model
            and (torch.is_grad_enabled() or self.sharded)
        ):
            # Through the DDP wrapper, so that backward all-reduces the gradient (FSDP: always,
            # its forward gathers the sharded weights).
            logp, ent = self.ddp(mb["input_ids"], **kwargs)
        else:
            out = sequence_logprobs(model, mb["input_ids"], **kwargs)
            logp, ent = out.logprobs, out.entropy
        if packed:
            index, _ = unpack_index(mb["cu_seqlens"])
            logp = logp[0][index]
            ent = ent[0][index] if ent is not None else None
        return logp, ent

    def _targets(self, mb: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """(mask, behaviour log-probs, advantages), all ``(n, L-1)``."""
        mask = self._target_mask(mb)
        blp, adv = mb["behavior_logprobs"], mb["advantages"]
        if is_packed(mb):
            index, valid = unpack_index(mb["cu_seqlens"])
            mask = mask[0][index] & valid
            blp, adv = blp[0][index], adv[0][index]
        return mask, blp, adv

    def _forward_backward(self, mb: dict[str, Any], tokens: int, seqs: int):
        mask, blp, adv = self._targets(mb)
        with self._autocast():
            logp, ent = self._logprobs(self.model, mb, entropy=self.compute_entropy)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref_model, mb, entropy=False)[0]
        prox = None
        if self.loss_cfg.loss_type in ("tis", "icepop", "decoupled"):
            # pi_old scored before the step's first update (PPO epochs), else the current
            # weights, which are pi_old when the step makes one update (module docstring).
            old = mb.get("old_logprobs")
            prox = old.to(logp.dtype) if old is not None else logp.detach()
        out = policy_loss(
            logp,
            blp,
            adv,
            mask,
            self.loss_cfg,
            prox_logp=prox,
            ref_logp=ref,
            seq_weights=mb["weights"],
            staleness=mb["staleness"],
            entropy=ent,
            num_tokens_global=float(max(tokens, 1)),
            num_seqs_global=float(max(seqs, 1)),
        )
        out.loss.backward()
        return out, int(mask.sum())
