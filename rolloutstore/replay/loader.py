"""``ReplayDataset``: a resumable torch ``IterableDataset`` of learner-ready replay batches.

Each step ``s`` the selector draws one *global* selection (a pure function of
seed, step, store version and config); rank ``r`` of ``world_size`` keeps rows
``r::world_size`` of it, so ranks never hand out the same rollout in one step.
DataLoader workers split steps (worker ``w`` builds steps ``w, w+W, ...``; the
DataLoader interleaves them back in order). Under ``max_uses`` every worker replays
the cheap metadata selection for every step so that reuse caps stay exact; only the
first worker of rank 0 records usage (so it draws every step); otherwise a worker
draws only its own steps. The state is the step: resume = skip to it.

Batch layout (padded, ``pack=False``), right-padded to the longest sequence::

    input_ids, attention_mask, position_ids      (B, T)   int64
    loss_mask, behavior_logprobs, advantages     (B, T-1) float32, aligned with
        trainer.algo.logprobs.sequence_logprobs: column t scores input_ids[:, t+1]
    policy_version, staleness, weights, rewards  (B,)   rewards/advantages: the reward
        version the selector read (newest re-scoring by default; see ``rolloutstore-train rescore``)
    rollout_ids, run_ids                          list[str]

Packed (``pack=True``): the same keys with B = 1 over the concatenation, plus
``cu_seqlens`` (n+1,) int32 and ``position_ids`` restarting at 0 for each
sequence; per-sequence arrays stay (n,). Loss positions that would predict one
sequence's first token from the previous one are masked.

    from torch.utils.data import DataLoader
    ds = ReplayDataset(store, ReplayConfig(window=16384), batch_size=64, learner_version=10)
    for batch in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"):
        ...

Workers must be spawned (or forkserver'd), not forked: Lance's I/O runtime is not
fork-safe, and a forked worker can crash once the parent has read the store.

Shutdown: the prefetch thread is stopped and joined when the iterator is closed or
collected, and at interpreter exit for iterators left unfinished (an ``atexit`` hook),
so no thread is inside Lance or DuckDB while the interpreter tears down; each
producer closes its selector's DuckDB connection when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from rolloutstore.facade import RolloutStore
from rolloutstore.replay.collate import (
    SAMPLING_COLUMNS,
    TOKEN_COLUMNS,
    TokenRows,
    collate,
    micro_batches,
)
from rolloutstore.replay.config import ReplayConfig
from rolloutstore.replay.selector import Selection, Selector

__all__ = ["ReplayDataset", "TokenCache", "TokenRows", "collate", "micro_batches"]

# Prefetch threads still running: stopped and joined at interpreter exit.
_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()
JOIN_TIMEOUT = 30.0  # seconds to wait for a producer at shutdown (one selection at most)


class _Prefetcher(threading.Thread):
    """Runs ``produce()`` ahead of the consumer into a bounded queue until ``stop``."""

    def __init__(self, produce: Callable[[], Iterator], depth: int):
        super().__init__(daemon=True, name="replay-prefetch")
        self.produce = produce
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.halt = threading.Event()
        self.done = object()

    def run(self) -> None:
        gen = self.produce()
        try:
            for item in gen:
                if not self._put(item):
                    return
            self._put(self.done)
        except BaseException as exc:  # surfaced in the consumer
            self._put(exc)
        finally:
            gen.close()  # closes the producer's selector (its DuckDB connection)

    def _put(self, item) -> bool:
        while not self.halt.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def shutdown(self) -> None:
        """Stop producing and wait for the thread, so it holds no Lance/DuckDB call."""
        self.halt.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.q.get_nowait()
        if self.is_alive() and self is not threading.current_thread():
            self.join(JOIN_TIMEOUT)


@atexit.register
def _shutdown_prefetchers() -> None:
    for t in list(_PREFETCHERS):
        t.shutdown()


class TokenCache:
    """Decoded token columns of the buffer, read in one sorted pass and reused across steps.

    A row's content never changes at a given row address (fragments are immutable
    and their ids never reused), so cached rows stay valid across store versions.
    Random takes from compressed columns decode whole blocks per row; reading the
    buffer once, sequentially, and taking from memory is several times faster when
    rollouts are replayed. Buffers over ``max_tokens`` are not cached.
    """

    def __init__(self, store: RolloutStore, max_tokens: int):
        self.store = store
        self.max_tokens = max_tokens
        self.addr = np.zeros(0, np.uint64)  # aligned with self.table rows
        self.table: pa.Table | None = None
        self._order: np.ndarray | None = None  # argsort of addr
        self._views: TokenRows | None = None  # self.table as TokenRows, made on first use

    def rows(self, sel: Selection, idx: np.ndarray | None = None) -> pa.Table:
        """Token columns of selection rows ``idx`` (all rows when None), in that order."""
        need = sel.row_addresses if idx is None else sel.row_addresses[idx]
        pos = self._positions(sel, need)
        if pos is None:
            return self._take(need)
        return self.table.take(pa.array(pos, pa.int64()))

    def token_rows(self, sel: Selection, idx: np.ndarray | None = None) -> TokenRows:
        """:meth:`rows` as views for :func:`collate`: from the cache, row offsets only."""
        need = sel.row_addresses if idx is None else sel.row_addresses[idx]
        pos = self._positions(sel, need)
        if pos is None:
            return TokenRows.of_table(self._take(need))
        if self._views is None:
            self._views = TokenRows.of_table(self.table)
        return self._views.take(pos)

    def _take(self, addresses: np.ndarray) -> pa.Table:
        """The token and sampling columns of rows ``addresses``, read from the store."""
        return self.store.take_rows(addresses, columns=TOKEN_COLUMNS + SAMPLING_COLUMNS)

    def _positions(self, sel: Selection, need: np.ndarray) -> np.ndarray | None:
        """Cache rows of addresses ``need`` (None: the buffer is not cached)."""
        if sel.buffer_addresses is None or sel.buffer_tokens > self.max_tokens:
            return None
        pos = self._lookup(need)
        if pos is None:
            self._load(sel.buffer_addresses)
            pos = self._lookup(need)
            assert pos is not None, "selected rows must lie in the buffer"
        return pos

    def _lookup(self, need: np.ndarray) -> np.ndarray | None:
        if self._order is None:
            self._order = np.argsort(self.addr, kind="stable")
        if not len(self.addr):
            return None
        at = np.minimum(np.searchsorted(self.addr, need, sorter=self._order), len(self.addr) - 1)
        pos = self._order[at]
        return pos if np.array_equal(self.addr[pos], need) else None

    def _load(self, buffer: np.ndarray) -> None:
        missing = np.setdiff1d(buffer, self.addr)
        if self.table is not None and len(self.addr) + len(missing) > 2 * len(buffer):
            # Drop rows that left the buffer before growing further.
            keep = np.isin(self.addr, buffer)
            self.table, self.addr = self.table.filter(pa.array(keep)), self.addr[keep]
        fresh = self._take(missing)
        table = fresh if self.table is None else pa.concat_tables([self.table, fresh])
        # One chunk per column: every later take then gathers from one buffer per column
        # (a take across chunks resolves each row's chunk first, and copies more).
        self.table = table.combine_chunks()
        self.addr = np.concatenate([self.addr, missing])
        self._order = self._views = None


class ReplayDataset(IterableDataset):
    """Replay batches from ``store`` under ``config``; see the module docstring.

    ``learner_version``: an int, or ``callable(step) -> int`` (e.g. reading the
    learner's current version). ``cache_tokens``: keep the buffer's decoded tokens in
    memory when it holds at most this many (see :class:`TokenCache`). ``micro_batch_tokens``: yield each step as a list
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
        cache_tokens: int = 32_000_000,
    ):
        if batch_size is None and max_tokens_per_batch is None:
            raise ValueError("ReplayDataset needs batch_size or max_tokens_per_batch")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}"
            )
        self.store = store
        self.config = (config or ReplayConfig()).seeded()
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.learner_version = learner_version
        self.pack = pack
        self.rank, self.world_size = rank, world_size
        self.micro_batch_tokens = micro_batch_tokens
        self.steps = steps
        self.run_id = run_id
        self.record_usage = record_usage
        # Steps <= this are in the usage log already (see Selector.usage_recorded_through).
        self.usage_recorded_through = -1
        self.prefetch = prefetch
        self.cache_tokens = cache_tokens
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

    def retarget(
        self, *, store: RolloutStore | None = None, config: ReplayConfig | None = None
    ) -> None:
        """Draw from ``store`` and/or with ``config`` from the next step not yet taken (a
        resumed run's store snapshot moving on, a controller moving ``fresh_fraction``).
        The seed stays: draws remain functions of (seed, step, store, config). An iterator
        made before this call still draws the old way: replace it with :meth:`restart`."""
        if config is not None and config.seed != self.config.seed:
            raise ValueError(
                f"retarget keeps the loader's seed ({self.config.seed}), got {config.seed}"
            )
        self.store = store if store is not None else self.store
        self.config = config if config is not None else self.config

    def restart(self, it: Iterator | None = None) -> Iterator:
        """A new iterator at the next step not yet taken (``it``, if given, is closed first:
        batches it prefetched but nobody took are drawn again, identically)."""
        if it is not None:
            it.close()
        self.load_state_dict(self.state_dict())
        return iter(self)

    # -- iteration ---------------------------------------------------------------------
    def _version(self, step: int) -> int:
        lv = self.learner_version
        return int(lv(step)) if callable(lv) else int(lv)

    def _build(self, step: int, sel: Selection, cache: TokenCache):
        shard = np.arange(self.rank, len(sel), self.world_size)
        rows = cache.token_rows(sel, shard)
        if self.micro_batch_tokens is None:
            return self._finish(collate(rows, sel, shard, pack=self.pack))
        parts = micro_batches(rows.lengths(), self.micro_batch_tokens)
        mbs = [self._finish(collate(rows.take(g), sel, shard[g], pack=self.pack)) for g in parts]
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
        selector.usage_recorded_through = self.usage_recorded_through
        cache = TokenCache(self.store, self.cache_tokens)
        # A step's draw is a pure function of (seed, step, store, config) but for use caps,
        # which count this run's earlier draws, and the usage log, which records every step:
        # only then does a worker draw the steps other workers build.
        every_step = self.config.max_uses is not None or selector.record_usage
        step = self.start_step
        try:
            while self.steps is None or step < self.steps:
                mine = (step - self.start_step) % nworkers == wid
                if mine or every_step:
                    sel = selector.sample(
                        self.batch_size,
                        self._version(step),
                        max_tokens=self.max_tokens_per_batch,
                        learner_step=step,
                    )
                if mine:
                    yield self._build(step, sel, cache)
                step += 1
        finally:
            selector.close()

    def __iter__(self) -> Iterator:
        if self.prefetch <= 0 or get_worker_info() is not None:
            # Workers already run ahead of the consumer; no extra thread there.
            for item in self._produce():
                self._yielded += 1
                yield item
            return
        t = _Prefetcher(self._produce, self.prefetch)
        _PREFETCHERS.add(t)
        t.start()
        try:
            while True:
                item = t.q.get()
                if item is t.done:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._yielded += 1
                yield item
        finally:
            t.shutdown()
            _PREFETCHERS.discard(t)
