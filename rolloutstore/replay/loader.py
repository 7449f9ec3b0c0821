"""``ReplayDataset``: a resumable torch ``IterableDataset`` of learner-ready replay batches.

Each step ``s`` the selector draws one *global* selection (a pure function of
seed, step, store version and config); rank ``r`` of ``world_size`` keeps rows
``r::world_size`` of it, so ranks never hand out the same rollout in one step.
DataLoader workers split steps (worker ``w`` builds steps ``w, w+W, ...``; the
DataLoader interleaves them back in order). Every worker replays the cheap
metadata selection for every step so that reuse caps stay exact, and only the
first worker of rank 0 records usage. The state is the step: resume = skip to it.

Batch layout (padded, ``pack=False``), right-padded to the longest sequence::

    input_ids, attention_mask, position_ids      (B, T)   int64
    loss_mask, behavior_logprobs, advantages     (B, T-1) float32, aligned with
        trainer.logprobs.sequence_logprobs: column t scores input_ids[:, t+1]
    policy_version, staleness, weights, rewards  (B,)
    rollout_ids                                   list[str]

Packed (``pack=True``): the same keys with B = 1 over the concatenation, plus
``cu_seqlens`` (n+1,) int32 and ``position_ids`` restarting at 0 for each
sequence; per-sequence arrays stay (n,). Loss positions that would predict one
sequence's first token from the previous one are masked.

    from torch.utils.data import DataLoader
    ds = ReplayDataset(store, ReplayConfig(window=16384), batch_size=64, learner_version=10)
    for batch in DataLoader(ds, batch_size=None, num_workers=2): ...
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..store import RolloutStore
from .config import ReplayConfig
from .selector import Selection, Selector

TOKEN_COLUMNS = ["prompt_ids", "completion_ids", "behavior_logprobs", "reward", "advantage"]


def _flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column as numpy, without per-token Python."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values, offsets


def _segment_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sequences of ``lengths``: (sequence index, position within it) of every element."""
    total = int(lengths.sum())
    seq = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    return seq, pos


def collate(rows: pa.Table, sel: Selection, idx: np.ndarray, *, pack: bool) -> dict[str, Any]:
    """Tensors for rows ``idx`` of ``sel`` (``rows`` aligned with the selection)."""
    rows = rows.take(pa.array(idx, pa.int64()))
    p_vals, p_off = _flat(rows["prompt_ids"])
    c_vals, c_off = _flat(rows["completion_ids"])
    l_vals, _ = _flat(rows["behavior_logprobs"])
    p_len, c_len = np.diff(p_off), np.diff(c_off)
    p_vals = p_vals[p_off[0] : p_off[-1]]
    c_vals = c_vals[c_off[0] : c_off[-1]]
    l_vals = l_vals[c_off[0] : c_off[-1]]
    lengths = p_len + c_len
    adv = np.nan_to_num(rows["advantage"].to_numpy(zero_copy_only=False).astype(np.float32))
    n = len(idx)

    # Every token's (sequence, position): prompts first, then completions.
    p_seq, p_pos = _segment_index(p_len)
    c_seq, c_pos = _segment_index(c_len)
    c_pos = c_pos + p_len[c_seq]
    if pack:
        starts = np.zeros(n, np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        width, p_row, c_row = int(lengths.sum()), np.zeros_like(p_seq), np.zeros_like(c_seq)
        p_col, c_col = starts[p_seq] + p_pos, starts[c_seq] + c_pos
        shape = (1, width)
    else:
        width = int(lengths.max())
        p_row, c_row, p_col, c_col = p_seq, c_seq, p_pos, c_pos
        shape = (n, width)
    input_ids = np.zeros(shape, np.int64)
    input_ids[p_row, p_col] = p_vals
    input_ids[c_row, c_col] = c_vals
    # Targets: column t scores token t+1, so a completion token at column c sits at c-1.
    loss_mask = np.zeros((shape[0], width - 1), np.float32)
    blp = np.zeros_like(loss_mask)
    adv_tok = np.zeros_like(loss_mask)
    loss_mask[c_row, c_col - 1] = 1.0
    blp[c_row, c_col - 1] = l_vals
    adv_tok[c_row, c_col - 1] = adv[c_seq]
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "behavior_logprobs": torch.from_numpy(blp),
        "advantages": torch.from_numpy(adv_tok),
    }
    if pack:
        seq_all, pos_all = _segment_index(lengths)
        out["position_ids"] = torch.from_numpy(pos_all[None, :])
        out["attention_mask"] = torch.ones(shape, dtype=torch.int64)
        cu = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        out["cu_seqlens"] = torch.from_numpy(cu)
    else:
        am = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        out["attention_mask"] = torch.from_numpy(am)
        out["position_ids"] = torch.from_numpy(np.arange(width)[None, :].repeat(n, 0) * am)
    rewards = rows["reward"].to_numpy(zero_copy_only=False).astype(np.float32)
    out.update(
        policy_version=torch.from_numpy(sel.policy_version[idx].copy()),
        staleness=torch.from_numpy(sel.staleness[idx].copy()),
        weights=torch.from_numpy(sel.weights[idx].copy()),
        rewards=torch.from_numpy(rewards),
        seq_advantages=torch.from_numpy(adv),
        num_tokens=int(lengths.sum()),
        num_loss_tokens=int(c_len.sum()),
        rollout_ids=[sel.rollout_ids[i] for i in idx],
        step=sel.step,
        learner_version=sel.learner_version,
        store_version=sel.store_version,
    )
    return out


def micro_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Split sequence indices, in order, into groups of at most ``max_tokens`` tokens each.

    A sequence longer than the budget forms a micro-batch of its own.
    """
    groups, cur, used = [], [], 0
    for i, n in enumerate(lengths.tolist()):
        if cur and used + n > max_tokens:
            groups.append(np.asarray(cur))
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(np.asarray(cur))
    return groups


class ReplayDataset(IterableDataset):
    """Replay batches from ``store`` under ``config``; see the module docstring.

    ``learner_version``: an int, or ``callable(step) -> int`` (e.g. reading the
    learner's current version). ``micro_batch_tokens``: yield each step as a list
    of micro-batch dicts of at most that many tokens (with the step's totals for
    loss normalisation). ``steps``: stop after this many steps (None: endless).
    """

    def __init__(
        self,
        store: RolloutStore,
        config: ReplayConfig | None = None,
        *,
        batch_size: int | None = None,
        max_tokens_per_batch: int | None = None,
        learner_version: int | Callable[[int], int] = 0,
        pack: bool = False,
        rank: int = 0,
        world_size: int = 1,
        micro_batch_tokens: int | None = None,
        steps: int | None = None,
        run_id: str = "default",
        record_usage: bool = True,
        prefetch: int = 2,
    ):
        if batch_size is None and max_tokens_per_batch is None:
            raise ValueError("ReplayDataset needs batch_size or max_tokens_per_batch")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}"
            )
        self.store = store
        self.config = config or ReplayConfig()
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.learner_version = learner_version
        self.pack = pack
        self.rank, self.world_size = rank, world_size
        self.micro_batch_tokens = micro_batch_tokens
        self.steps = steps
        self.run_id = run_id
        self.record_usage = record_usage
        self.prefetch = prefetch
        self.start_step = 0
        self._yielded = 0

    # -- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Small JSON dict: the next step to yield (count only batches the consumer took)."""
        return {
            "step": self.start_step + self._yielded,
            "seed": self.config.seed,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("world_size", self.world_size) != self.world_size:
            raise ValueError(
                f"state was saved with world_size {state['world_size']}, this loader has "
                f"{self.world_size}; resume with the same number of ranks"
            )
        self.start_step = int(state["step"])
        self._yielded = 0

    # -- iteration ---------------------------------------------------------------------
    def _version(self, step: int) -> int:
        lv = self.learner_version
        return int(lv(step)) if callable(lv) else int(lv)

    def _build(self, step: int, sel: Selection):
        shard = np.arange(self.rank, len(sel), self.world_size)
        rows = self.store.take_rows(sel.row_addresses, columns=TOKEN_COLUMNS)
        if self.micro_batch_tokens is None:
            return self._finish(collate(rows, sel, shard, pack=self.pack))
        p = rows["prompt_ids"].combine_chunks()
        c = rows["completion_ids"].combine_chunks()
        lengths = (np.diff(p.offsets.to_numpy()) + np.diff(c.offsets.to_numpy()))[shard]
        parts = micro_batches(lengths, self.micro_batch_tokens)
        mbs = [self._finish(collate(rows, sel, shard[g], pack=self.pack)) for g in parts]
        total = sum(mb["num_loss_tokens"] for mb in mbs)
        for mb in mbs:
            mb["step_loss_tokens"] = total
            mb["step_sequences"] = len(shard)
        return mbs

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        if torch.cuda.is_available():
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    batch[k] = v.pin_memory()
        return batch

    def _produce(self) -> Iterator:
        info = get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info else (0, 1)
        # Each worker gets its own handles (a store pickles as URI + version).
        selector = Selector(
            self.store,
            self.config,
            run_id=self.run_id,
            record_usage=self.record_usage and self.rank == 0 and wid == 0,
        )
        selector.load_state_dict({"step": self.start_step})
        step = self.start_step
        while self.steps is None or step < self.steps:
            sel = selector.sample(
                self.batch_size,
                self._version(step),
                max_tokens=self.max_tokens_per_batch,
                learner_step=step,
            )
            if (step - self.start_step) % nworkers == wid:
                yield self._build(step, sel)
            step += 1

    def __iter__(self) -> Iterator:
        if self.prefetch <= 0 or get_worker_info() is not None:
            # Workers already run ahead of the consumer; no extra thread there.
            for item in self._produce():
                self._yielded += 1
                yield item
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        done = object()

        def work():
            try:
                for item in self._produce():
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                q.put(done)
            except BaseException as exc:  # surfaced in the consumer
                q.put(exc)

        t = threading.Thread(target=work, daemon=True, name="replay-prefetch")
        t.start()
        try:
            while True:
                item = q.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._yielded += 1
                yield item
        finally:
            stop.set()
