"""The two generated rollout distributions the peer benchmarks run on (issue [speed]).

``table``: the workload of the [speed] issue's table: lognormal completion lengths
around 800 tokens, groups of 16, Zipf(1.2) ids over a 151k vocabulary, *bursty*
behaviour log-probs (runs of confident tokens broken by runs of uncertain ones, as
a sampled LLM produces them, unlike the i.i.d. mixture of rolloutstore/io/proxy.py).

``long``: longer, burstier completions (lognormal around 2,400 tokens, a heavier
tail, longer uncertain runs), groups of 8, prompts up to 1k tokens.

Both are seeded and deterministic: the same (name, rollouts, seed) gives the same
tables.

    from tools.peer_workloads import workload_batches
    for table in workload_batches("table", 20_000, seed=0): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolloutstore.io.proxy import proxy_batches


@dataclass(frozen=True)
class Workload:
    group_size: int
    mean_completion_tokens: int
    prompt_tokens: tuple[int, int]
    max_completion_tokens: int
    # Two-state Markov chain over tokens: confident <-> uncertain.
    p_enter_uncertain: float  # per token, from a confident run
    p_leave_uncertain: float  # per token, from an uncertain run
    confident_scale: float  # -Exp(scale) nats
    uncertain_scale: float


WORKLOADS = {
    "table": Workload(16, 800, (64, 384), 8192, 0.04, 0.25, 0.02, 2.0),
    "long": Workload(8, 2400, (128, 1024), 16384, 0.02, 0.08, 0.01, 2.5),
}


def bursty_logprobs(rng: np.random.Generator, n: int, w: Workload) -> np.ndarray:
    """``n`` log-probs whose confident/uncertain state follows a two-state Markov chain."""
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    # Run lengths are geometric; draw enough alternating runs to cover n tokens.
    runs, covered, uncertain = [], 0, False
    while covered < n:
        k = 4096
        conf = rng.geometric(w.p_enter_uncertain, size=k)
        unc = rng.geometric(w.p_leave_uncertain, size=k)
        pair = np.empty(2 * k, dtype=np.int64)
        first, second = (unc, conf) if uncertain else (conf, unc)
        pair[0::2], pair[1::2] = first, second
        runs.append(pair)
        covered += int(pair.sum())
    lengths = np.concatenate(runs)
    state = np.zeros(len(lengths), dtype=bool)
    state[1::2] = True  # odd runs are uncertain (the chain starts confident)
    is_unc = np.repeat(state, lengths)[:n]
    scale = np.where(is_unc, w.uncertain_scale, w.confident_scale)
    return (-rng.exponential(1.0, size=n) * scale).astype(np.float32)


def workload_batches(
    name: str, rollouts: int, *, seed: int = 0, batch_rollouts: int = 1024
) -> Iterator[pa.Table]:
    """Seeded tables of ``rollouts`` rows of workload ``name`` in the schema's field names."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    batch_rollouts -= batch_rollouts % w.group_size
    rng = np.random.default_rng([seed, 7])
    for table in proxy_batches(
        rollouts,
        seed=seed,
        group_size=w.group_size,
        mean_completion_tokens=w.mean_completion_tokens,
        prompt_tokens=w.prompt_tokens,
        max_completion_tokens=w.max_completion_tokens,
        batch_rollouts=batch_rollouts,
        run_id=f"peer-{name}",
    ):
        col = table.column("behavior_logprobs").combine_chunks()
        values = bursty_logprobs(rng, len(col.values), w)
        bursty = pa.ListArray.from_arrays(col.offsets, pa.array(values, type=pa.float32()))
        idx = table.schema.get_field_index("behavior_logprobs")
        yield table.set_column(idx, "behavior_logprobs", bursty)


def workload_table(name: str, rollouts: int, *, seed: int = 0) -> pa.Table:
    """All of :func:`workload_batches` as one table."""
    return pa.concat_tables(list(workload_batches(name, rollouts, seed=seed)))


def completion_tokens(table: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(table.column("completion_ids"))).as_py())
