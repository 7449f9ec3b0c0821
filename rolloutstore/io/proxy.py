"""Seeded proxy rollouts: realistic-looking token ids and log-probs without a model.

Used by the demo, the storage benchmark and the tests. The statistics follow
measured LLM rollouts (docs/platform.md): Zipf(1.2) token ids over a 151k vocabulary, behaviour
log-probs drawn from a mixture (70% ~ -Exp(0.02), 30% ~ -Exp(2)), lognormal
completion lengths, GRPO groups of ``group_size`` samples of one prompt.

    python -m rolloutstore.io.proxy OUT.parquet --rollouts 20000
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

VOCAB_SIZE = 151_646


def _zipf_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    # Zipf draws are unbounded; folding the tail back into the vocabulary keeps
    # the head's frequencies (what compression sees) intact.
    return ((rng.zipf(1.2, size=n) - 1) % vocab).astype(np.int32)


def _logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    confident = rng.random(n) < 0.7
    scale = np.where(confident, 0.02, 2.0)
    return (-rng.exponential(1.0, size=n) * scale).astype(np.float32)


def _list_array(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def proxy_batches(
    rollouts: int,
    *,
    seed: int = 0,
    group_size: int = 8,
    mean_completion_tokens: int = 512,
    prompt_tokens: tuple[int, int] = (64, 256),
    embedding_dim: int = 64,
    rollouts_per_version: int = 1024,
    batch_rollouts: int = 1024,
    run_id: str = "proxy",
    vocab_size: int = VOCAB_SIZE,
    max_completion_tokens: int = 8192,
    start_index: int = 0,
) -> Iterator[pa.Table]:
    """Yield tables of proxy rollouts in the schema-v1 field names (ids left to the store)."""
    if batch_rollouts % group_size:
        raise ValueError(
            f"batch_rollouts ({batch_rollouts}) must be a multiple of group_size ({group_size})"
        )
    rng = np.random.default_rng(seed)
    sigma = 0.6
    mu = np.log(mean_completion_tokens) - sigma**2 / 2
    done = 0
    while done < rollouts:
        n = min(batch_rollouts, rollouts - done)
        n_groups = -(-n // group_size)
        index = start_index + done + np.arange(n)
        group = index // group_size
        p_len_g = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=n_groups)
        prompts_g = [_zipf_ids(rng, int(k), vocab_size) for k in p_len_g]
        local_group = group - group[0]
        p_len = p_len_g[local_group]
        prompt_ids = np.concatenate([prompts_g[g] for g in local_group])
        c_len = np.clip(rng.lognormal(mu, sigma, size=n), 8, max_completion_tokens).astype(np.int64)
        total = int(c_len.sum())
        completion_ids = _zipf_ids(rng, total, vocab_size)
        logprobs = _logprobs(rng, total)
        reward = (rng.random(n) < 0.4).astype(np.float32)
        # GRPO advantage per group, computed the way the generator would.
        r_g = reward.reshape(-1, group_size) if n % group_size == 0 else None
        if r_g is not None:
            adv = ((r_g - r_g.mean(1, keepdims=True)) / (r_g.std(1, keepdims=True) + 1e-6)).ravel()
        else:
            adv = np.zeros(n, dtype=np.float32)
        emb = rng.standard_normal((n, embedding_dim)).astype(np.float32)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        finish = np.where(c_len >= max_completion_tokens, "length", "stop")
        yield pa.table(
            {
                "run_id": pa.array([run_id] * n),
                "group_id": pa.array([f"{run_id}-g{g}" for g in group]),
                "sample_index": pa.array((index % group_size).astype(np.int32)),
                "policy_version": pa.array((index // rollouts_per_version).astype(np.int64)),
                "prompt_ids": _list_array(prompt_ids, p_len, pa.int32()),
                "completion_ids": _list_array(completion_ids, c_len, pa.int32()),
                "behavior_logprobs": _list_array(logprobs, c_len, pa.float32()),
                "finish_reason": pa.array(finish),
                "temperature": pa.array(np.full(n, 1.0, dtype=np.float32)),
                "top_p": pa.array(np.full(n, 1.0, dtype=np.float32)),
                "max_tokens": pa.array(np.full(n, max_completion_tokens, dtype=np.int32)),
                "seed": pa.array((seed * 1_000_003 + group).astype(np.int64)),
                "logprobs_mode": pa.array(["processed_logprobs"] * n),
                "generator": pa.array(["proxy"] * n),
                "reward": pa.array(reward),
                "advantage": pa.array(adv.astype(np.float32)),
                "embedding": pa.FixedSizeListArray.from_arrays(
                    pa.array(emb.ravel()), embedding_dim
                ),
                "task": pa.array(["proxy"] * n),
            }
        )
        done += n


def proxy_table(rollouts: int, **kwargs) -> pa.Table:
    """All of :func:`proxy_batches` as one table."""
    return pa.concat_tables(list(proxy_batches(rollouts, **kwargs)))


def main(argv: list[str] | None = None) -> None:
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="Parquet file to write")
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pq.write_table(proxy_table(args.rollouts, seed=args.seed), args.out, compression="zstd")


if __name__ == "__main__":
    main()
