"""``ReplayGRPOTrainer``: TRL's ``GRPOTrainer`` with a rollout store as its replay buffer.

Each time TRL generates a batch (``GRPOTrainer._generate_and_score_completions``), the
trainer appends every completion to a :class:`~rolloutstore.RolloutStore` (token ids,
behaviour log-probs, reward, TRL's group advantage, ``policy_version`` = TRL's
``state.global_step``, one ``group_id`` per prompt's ``num_generations`` samples), then
draws the batch it trains on from the store with a :class:`~rolloutstore.Selector`
under a :class:`~rolloutstore.ReplayConfig` (``window``, ``max_staleness``,
``fresh_fraction``, ...), and turns those rows back into the inputs dict TRL's loss reads.
Replayed rows carry their stored behaviour log-probs as ``old_per_token_logps``, so
TRL's clipped ratio ``exp(logp - old_logp)`` is taken against the policy that sampled them.

Behaviour log-probs are TRL's ``old_per_token_logps`` when TRL computes them
(``num_iterations > 1`` or generation not aligned with gradient accumulation); otherwise
they are computed here, without grad, from the model that just generated (the same
temperature-scaled log-softmax TRL uses). ``top_p``/``top_k`` are not applied, as in TRL.

Resume: ``trainer.train(resume_from_checkpoint=...)`` restores the selector's step from
``rolloutstore_state.json`` in the checkpoint; rows this run appended after that checkpoint
(a killed continuation the resumed run retakes) are left out of selection. A damaged state
file, another ``run_id``, another store (its URI) or a store older than the checkpoint (at a
lower version) is refused with :class:`~rolloutstore.errors.ResumeStateError`.

    from rolloutstore import ReplayConfig, RolloutStore
    from rolloutstore.integrations.trl import ReplayGRPOTrainer
    trainer = ReplayGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                train_dataset=..., store=RolloutStore.open("runs/x/store"),
                                replay=ReplayConfig(window=4096, max_staleness=4,
                                                    fresh_fraction=0.5))
    trainer.train()

Multi-turn: with ``tools``, ``environment_factory`` or a ``rollout_func`` returning
``env_mask``, TRL's ``tool_mask`` (1 = sampled by the policy, 0 = tool / environment
tokens) is stored as the row's ``loss_mask`` with ``turns`` (runs of 1s: assistant turns,
runs of 0s: tool turns), behaviour log-probs 0 on the tool tokens; replayed rows give it
back to TRL as ``tool_mask``, so a replayed trajectory trains on its model tokens only.

Supported: one process, transformers generation (``use_vllm=False``), ``beta=0``, text
prompts (plain or conversational), no images; anything else raises ``UsageError`` (before the
store is opened, so a refused trainer creates no store).
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime
from typing import Any

from rolloutstore.errors import MissingDependencyError, ResumeStateError, UsageError

try:
    import torch
    import transformers
    import trl
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import pad
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"rolloutstore.integrations.trl needs TRL ({exc}); install it with "
        "`pip install 'rolloutstore[trl]'`"
    ) from exc

from rolloutstore.facade import RolloutStore
from rolloutstore.replay import ReplayConfig, Selection, Selector
from rolloutstore.schema.ids import uuid7_strings
from rolloutstore.schema.turns import turns_from_mask

__all__ = ["LOGPROBS_MODE", "STATE_FILE", "ReplayGRPOTrainer", "read_state"]

STATE_FILE = "rolloutstore_state.json"
# The trainer model's log_softmax(logits / temperature) at the sampled token (TRL's
# old_per_token_logps); generation's top_p / top_k / min_p are not applied.
LOGPROBS_MODE = "trl_old_per_token_logps"
ORPHANS_SQL = "NOT (run_id = ? AND created_at > ? AND created_at < ?)"


class ReplayGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose training batches come from ``store`` through ``replay``.

    ``store``: a :class:`RolloutStore` or its URI (created if missing). ``replay``: which
    rows form the buffer and how a batch is drawn (default: window 4096, staleness <= 4,
    half of each batch fresh). ``run_id`` tags this run's rows and usage. All other
    arguments are ``GRPOTrainer``'s. ``last_selection`` is the newest draw.
    """

    def __init__(
        self,
        *args: Any,
        store: RolloutStore | str | os.PathLike,
        replay: ReplayConfig | None = None,
        run_id: str = "trl",
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.replay_config = replay or ReplayConfig(
            window=4096, max_staleness=4, fresh_fraction=0.5
        )
        self.run_id = run_id
        self._check_supported()  # before the store is opened: a refusal creates none
        self.store = store if isinstance(store, RolloutStore) else RolloutStore.open(store)
        self.selector = Selector(self.store, self.replay_config, run_id=run_id)
        self.last_selection: Selection | None = None
        self._orphans: list[tuple[str, str]] = []  # (saved_at, resumed_at) ISO times
        self._captured: dict[str, Any] = {}

    # -- configuration -----------------------------------------------------------------
    def _check_supported(self) -> None:
        bad = []
        if self.accelerator.num_processes > 1:
            bad.append(f"num_processes={self.accelerator.num_processes} (one process only)")
        if self.use_vllm:
            bad.append("use_vllm=True (transformers generation only)")
        if self.beta != 0.0:
            bad.append(f"beta={self.beta} (no reference model for replayed rows: use beta=0)")
        if bad:
            raise UsageError(
                "ReplayGRPOTrainer does not support " + "; ".join(bad) + ": expected one process, "
                "use_vllm=False, beta=0; use GRPOTrainer for these settings"
            )
        window = self.replay_config.window
        if window is not None and window < self._generation_rows():
            raise UsageError(
                f"ReplayConfig.window={window} is smaller than one generation batch "
                f"({self._generation_rows()} rows = per_device_train_batch_size x "
                "steps_per_generation); raise the window"
            )

    def _generation_rows(self) -> int:
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    # -- TRL hooks ---------------------------------------------------------------------
    def _generate(self, prompts: list):
        out = super()._generate(prompts)
        # (prompt_ids, completion_ids, tool_mask, completions, logprobs, ...): unpadded lists.
        self._captured.update(
            prompt_ids=out[0], completion_ids=out[1], tool_mask=out[2], completions=out[3]
        )
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._captured.update(prompts=prompts, rewards_per_func=rewards_per_func)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._captured = {}
        fresh = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return fresh
        for key in ("pixel_values", "ref_per_token_logps"):
            if key in fresh:
                raise UsageError(f"ReplayGRPOTrainer cannot store TRL's {key!r}: text-only GRPO")
        version = int(self.state.global_step)
        self._append(fresh, self._behavior_logprobs(fresh), version)
        rows = self._generation_rows()
        sel = self.selector.sample(rows, learner_version=version)
        if len(sel) != rows:
            raise UsageError(
                f"the replay draw returned {len(sel)} rows, TRL needs {rows}; with "
                f"{self.replay_config} use whole_groups=False and no per_prompt_cap below "
                "the group size"
            )
        self.last_selection = sel
        return self._inputs(sel)

    # -- fresh rows into the store -----------------------------------------------------
    def _behavior_logprobs(self, fresh: dict[str, Any]) -> torch.Tensor:
        """(B, C) log-probs of the sampled tokens under the generating weights."""
        old = fresh.get("old_per_token_logps")
        if old is not None and not self.mask_truncated_completions:
            return old
        # Unmasked completions: a masked (truncated) row still needs its real log-probs.
        lengths = [len(c) for c in self._captured["completion_ids"]]
        mask = torch.zeros_like(fresh["completion_mask"])
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        ids = torch.cat([fresh["prompt_ids"], fresh["completion_ids"]], dim=1)
        attention = torch.cat([fresh["prompt_mask"], mask], dim=1)
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                ids,
                attention,
                fresh["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _append(self, fresh: dict[str, Any], behavior: torch.Tensor, version: int) -> None:
        cap = self._captured
        prompt_ids, completion_ids = cap["prompt_ids"], cap["completion_ids"]
        n, g = len(completion_ids), self.num_generations
        # TRL's RepeatSampler puts each prompt's num_generations samples next to each other,
        # and advantages are normalised over those blocks: one block is one GRPO group.
        assert n % g == 0, (n, g)
        weights = self.reward_weights.to(cap["rewards_per_func"].device)
        per_func = cap["rewards_per_func"][:n]
        rewards = (per_func * weights).nansum(dim=1)
        unscored = torch.isnan(per_func).all(dim=1)
        advantages = fresh["advantages"].float().cpu().tolist()
        behavior = behavior.float().clamp(max=0.0).cpu()
        masks = cap.get("tool_mask")  # None: single-turn, every token the policy's
        groups = uuid7_strings(n // g)
        eos = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        generator = f"transformers/{transformers.__version__}+trl/{trl.__version__}"
        rows = []
        for i in range(n):
            c = list(completion_ids[i])
            info = {name: _num(per_func[i, k]) for k, name in enumerate(self.reward_func_names)}
            logps = behavior[i, : len(c)].tolist()
            turn_cols = {}
            if masks is not None:
                mask = [int(b) for b in masks[i]]
                logps = [lp if b else 0.0 for lp, b in zip(logps, mask, strict=True)]
                turn_cols = {"loss_mask": mask, "turns": turns_from_mask(mask)}
            rows.append(
                {
                    "run_id": self.run_id,
                    "group_id": groups[i // g],
                    "sample_index": i % g,
                    "policy_version": version,
                    "policy_id": self.run_id,
                    "prompt_ids": list(prompt_ids[i]),
                    "completion_ids": c,
                    "behavior_logprobs": logps,
                    "prompt_text": _text(cap["prompts"][i]),
                    "completion_text": _text(cap["completions"][i]),
                    "finish_reason": "stop" if c and c[-1] in eos else "length",
                    "temperature": float(self.temperature),
                    "top_p": float(self.top_p),
                    "top_k": int(self.top_k or 0),
                    "max_tokens": int(self.max_completion_length),
                    "logprobs_mode": LOGPROBS_MODE,
                    "generator": generator,
                    "reward": None if unscored[i] else float(rewards[i]),
                    "reward_info": json.dumps(info),
                    "advantage": advantages[i],
                    **turn_cols,
                }
            )
        self.store.append(rows)

    # -- selected rows into TRL's inputs -----------------------------------------------
    def _inputs(self, sel: Selection) -> dict[str, Any]:
        """TRL's inputs dict for the drawn rows, padded as ``_generate_and_score_completions`` pads."""
        table = self.store.checkout(sel.store_version).take_rows(
            sel.row_addresses,
            columns=["prompt_ids", "completion_ids", "behavior_logprobs", "loss_mask"],
        )
        device, pad_id, multiple = (
            self.accelerator.device,
            self._tokenizer.pad_token_id,
            self.pad_to_multiple_of,
        )
        prompts = [torch.tensor(p, dtype=torch.long) for p in table["prompt_ids"].to_pylist()]
        completions = [
            torch.tensor(c, dtype=torch.long) for c in table["completion_ids"].to_pylist()
        ]
        logps = [
            torch.tensor(lp, dtype=torch.float32) for lp in table["behavior_logprobs"].to_pylist()
        ]
        ones = [torch.ones_like(t) for t in prompts], [torch.ones_like(t) for t in completions]
        completion_mask = pad(ones[1], 0, "right", multiple)
        if self.mask_truncated_completions:  # as TRL does for its fresh rows
            eos = {*self.eos_token_ids, pad_id}
            truncated = torch.tensor([int(c[-1]) not in eos for c in completions])
            completion_mask = completion_mask * (~truncated).unsqueeze(1).long()
        completion_mask = completion_mask.to(device)
        masks = table["loss_mask"].to_pylist()  # every read shows an all-ones mask as ones
        extra = {}
        if any(0 in m for m in masks):  # TRL's tool_mask, padded with 1 as TRL pads it
            tool_mask = pad(
                [torch.tensor(m, dtype=torch.long) for m in masks], 1, "right", multiple
            )
            extra["tool_mask"] = tool_mask.to(device)
        loss_mask = completion_mask * extra.get("tool_mask", 1)
        advantages = torch.nan_to_num(torch.as_tensor(sel.advantages, dtype=torch.float32), nan=0.0)
        return {
            "prompt_ids": pad(prompts, pad_id, "left", multiple).to(device),  # (B, P)
            "prompt_mask": pad(ones[0], 0, "left", multiple).to(device),  # (B, P)
            "completion_ids": pad(completions, pad_id, "right", multiple).to(device),  # (B, C)
            "completion_mask": completion_mask,  # (B, C)
            "old_per_token_logps": pad(logps, 0.0, "right", multiple).to(device),  # (B, C)
            "advantages": advantages.to(device),  # (B,)
            "num_items_in_batch": self.accelerator.gather(loss_mask.sum()).sum(),
            **extra,
        }

    # -- checkpoint and resume ---------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        path = os.path.join(self._get_output_dir(trial=trial), folder, STATE_FILE)
        state = {
            "selector": self.selector.state_dict(),
            "store_uri": self.store.uri,
            "store_version": self.store.version,
            "run_id": self.run_id,
            "global_step": int(self.state.global_step),
            "saved_at": datetime.now(UTC).isoformat(),
            "orphans": self._orphans,
        }
        with open(path, "w") as f:
            json.dump(state, f, indent=1)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint is not None else None
        if path is None or not os.path.exists(path):
            return
        state = read_state(path)
        self._check_resume(state, path)
        # Rows this run appended after the checkpoint belong to a continuation that is being
        # retaken: keep them out of selection (they stay in the store).
        orphans = [*state.get("orphans", []), (state["saved_at"], datetime.now(UTC).isoformat())]
        self._orphans = [tuple(o) for o in orphans]
        cfg = self.replay_config
        extra = " AND ".join([ORPHANS_SQL] * len(self._orphans))
        params = [p for a, b in self._orphans for p in (self.run_id, _ts(a), _ts(b))]
        where = extra if cfg.where is None else f"({cfg.where}) AND {extra}"
        self.replay_config = dataclasses.replace(
            cfg, where=where, where_params=(*cfg.where_params, *params)
        )
        self.selector = Selector(self.store, self.replay_config, run_id=self.run_id)
        self.selector.load_state_dict(state["selector"])

    def _check_resume(self, state: dict[str, Any], path: str) -> None:
        """Refuse a checkpoint of another run, or one saved against another store: the
        selector's draws continue only over the store the checkpoint trained from."""
        if state["run_id"] != self.run_id:
            raise ResumeStateError(
                f"{path} belongs to run_id {state['run_id']!r}, this trainer has run_id "
                f"{self.run_id!r}; pass run_id={state['run_id']!r} to resume it"
            )
        saved, here = state["store_uri"], self.store.uri
        if _same_store(saved, here) and self.store.version >= state["store_version"]:
            return
        why = (
            f"was saved training from the store {saved!r}, this trainer has {here!r}"
            if not _same_store(saved, here)
            else f"was saved at store version {state['store_version']}, the store {here!r} is "
            f"at version {self.store.version} (an older or a new store in its place)"
        )
        raise ResumeStateError(
            f"{path} {why}; an exact resume draws from the rows the checkpoint trained on: "
            f"pass store={saved!r} as it was at the checkpoint, or start a new run (another "
            "output_dir) without resume_from_checkpoint"
        )


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``rolloutstore_state.json``, checked; :class:`ResumeStateError` names
    the file and what is wrong when it is damaged (not JSON, keys missing or of the wrong type)."""
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _damaged(path, f"it does not read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise _damaged(path, f"expected a JSON object, found {type(state).__name__}")
    want = {"selector": dict, "run_id": str, "saved_at": str, "store_uri": str,
            "store_version": int}  # fmt: skip
    for key, kind in want.items():
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = "nothing" if key not in state else f"{type(value).__name__} {value!r:.60}"
            raise _damaged(path, f"expected {key!r} a {kind.__name__}, found {found}")
    step = state["selector"].get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _damaged(path, f"expected selector.step a step number, found {step!r:.60}")
    orphans = state.get("orphans", [])
    times = [state["saved_at"]]
    if not isinstance(orphans, list) or not all(
        isinstance(o, list) and len(o) == 2 and all(isinstance(t, str) for t in o) for o in orphans
    ):
        raise _damaged(path, "expected 'orphans' a list of [saved_at, resumed_at] pairs")
    times += [t for o in orphans for t in o]
    for t in times:
        try:
            _ts(t)
        except ValueError:
            raise _damaged(path, f"expected ISO-8601 times, found {t!r:.60}") from None
    return state


def _damaged(path: str | os.PathLike, what: str) -> ResumeStateError:
    return ResumeStateError(
        f"{os.fspath(path)} is damaged: {what}; resume from another checkpoint, or start a new "
        "run without resume_from_checkpoint"
    )


def _same_store(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v


def _text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x)


def _ts(iso: str) -> datetime:
    return datetime.fromisoformat(iso)
