"""ingest --from ... --score-with: batched scoring equals row-by-row scoring, and every input
(files, flags, folders, tokenizer vs model, row lengths, the store's tokenizer) is checked
before the scoring model loads; bad ones are one line naming the flag or row, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutstore import RolloutStore
from trainer.cli import main
from trainer.models.tiny import make_tiny_model
from trainer.rollout.hf import teacher_forced_logprobs
from trainer.rollout.scoring import ScoringModel, batched_logprobs, length_batches

VERL = Path(__file__).resolve().parents[1] / "data" / "verl_rollouts.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, num_layers=2, num_texts=300, chat_template=True)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Records every model / tokenizer load (and lets it happen)."""
    seen: list[str] = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained

        def spy(*a, _real=real, _name=cls.__name__, **k):
            seen.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    return seen


def _error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in "\n".join(lines)
    return lines[-1]


def _ingest(store: Path, *args: str, files=(VERL,)) -> int:
    return main(["ingest", str(store), *map(str, files), "--from", "verl", "-q", *args])


# -- batched == row by row ------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [(1.0, 1.0, 0), (0.7, 0.98, 400)])
def test_batched_logprobs_equal_row_by_row_across_lengths(model, sampling):
    temperature, top_p, top_k = sampling
    g = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randint(1, 500, (p,), generator=g).tolist(),
         torch.randint(1, 500, (c,), generator=g).tolist())
        for p, c in [(3, 1), (40, 90), (7, 12), (1, 30), (25, 25), (60, 3)]
    ]  # fmt: skip
    # One batch holds them all: the short rows are padded to the longest (130 tokens).
    assert length_batches([len(p) + len(c) for p, c in pairs], 10_000) == [[0, 2, 3, 4, 5, 1]]
    got = batched_logprobs(model, pairs, temperature, top_p, top_k, batch_tokens=10_000)
    compared = 0
    with torch.no_grad():
        for (p, c), lp in zip(pairs, got):
            want = teacher_forced_logprobs(model, p, c, temperature, top_p, top_k)
            assert lp.shape == (len(c),) and lp.dtype == torch.float32
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(lp))  # same tokens outside top-p / top-k
            assert torch.allclose(lp[finite], want[finite], rtol=0, atol=1e-5)
            compared += int(finite.sum())
    assert compared > 100


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=8),
    budget=st.integers(1, 200),
)
def test_any_batching_gives_the_row_by_row_logprobs(model, lengths, budget):
    pairs = [([(7 * i + j) % 500 for j in range(p)], [(11 * i + j) % 500 for j in range(c)])
             for i, (p, c) in enumerate(lengths)]  # fmt: skip
    got = batched_logprobs(model, pairs, 0.8, batch_tokens=budget)
    with torch.no_grad():
        for (p, c), lp in zip(pairs, got):
            assert (lp - teacher_forced_logprobs(model, p, c, 0.8)).abs().max() < 1e-5


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=40), budget=st.integers(1, 2000))
def test_length_batches_cover_every_row_within_the_budget(lengths, budget):
    batches = length_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:  # a row longer than the budget goes alone
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget


def test_progress_is_reported_per_scored_batch(model_dir):
    from rolloutstore.io.interop import TextImporter, TextImportOptions
    from trainer.rollout.scoring import ScoringConfig
    from trainer.rollout.text_import import TextRowTransformer

    options = TextImportOptions(source="verl", score_with=str(model_dir))
    tr = TextRowTransformer(options, ScoringConfig(batch_tokens=64))
    seen: list[int] = []
    tr.on_scored = seen.append
    importer = TextImporter(options, tr)
    rows = [json.loads(line) for line in VERL.read_text().splitlines()]
    importer.scan(rows)
    out = importer(rows, 0)
    assert sum(seen) == len(rows) == len(out) and len(seen) > 1


def test_the_cli_shows_a_rows_bar(tmp_path, model_dir, capsys):
    rc = main(["ingest", str(tmp_path / "s"), str(VERL), "--from", "verl",
               "--score-with", str(model_dir), "--score-batch-tokens", "64"])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "scoring verl_rollouts.jsonl" in err and "/5 [" in err and "rows/s" in err


# -- checked before anything loads -----------------------------------------------------------------
def test_a_missing_file_is_refused_before_any_model_loads(tmp_path, model_dir, loads, capsys):
    missing = tmp_path / "rollouts.jsonl"
    rc = _ingest(tmp_path / "s", "--score-with", str(model_dir), files=(VERL, missing))
    assert rc == 2
    assert str(missing) in _error(capsys) and loads == []
    assert not (tmp_path / "s").exists()


def _without_tokenizer(model_dir: Path, dest: Path, keep=()) -> Path:
    dest.mkdir()
    for f in ("config.json", "model.safetensors", *keep):
        shutil.copy(model_dir / f, dest / f)
    return dest


@pytest.mark.parametrize(
    "case, flag, needles",
    [
        ("model is a file", "--score-with", ["is a file, not a folder"]),
        ("tokenizer is a file", "--tokenizer", ["is a file, not a folder"]),
        ("no model folder", "--score-with", ["no such folder"]),
        ("empty model folder", "--score-with", ["has no config.json"]),
        ("model without tokenizer", "--score-with", ["no tokenizer files", "--tokenizer DIR"]),
        ("tokenizer_config only", "--score-with", ["without a vocabulary", "--tokenizer DIR"]),
        ("tokenizer beyond the vocabulary", "--tokenizer", ["ids go up to 1023", "512"]),
        ("another vocabulary", "--tokenizer", ["is not the tokenizer of --score-with"]),
    ],
)
def test_bad_score_with_or_tokenizer_is_one_line_naming_the_flag(
    tmp_path, model_dir, loads, capsys, case, flag, needles
):
    m, tok = str(model_dir), None
    if case == "model is a file":
        m = str(model_dir / "config.json")
    elif case == "tokenizer is a file":
        tok = str(model_dir / "tokenizer.json")
    elif case == "no model folder":
        m = str(tmp_path / "modle")
    elif case == "empty model folder":
        (tmp_path / "empty").mkdir()
        m = str(tmp_path / "empty")
    elif case == "model without tokenizer":
        m = str(_without_tokenizer(model_dir, tmp_path / "bare"))
    elif case == "tokenizer_config only":  # once refused as "empty completion"
        m = str(_without_tokenizer(model_dir, tmp_path / "bare", keep=["tokenizer_config.json"]))
    elif case == "tokenizer beyond the vocabulary":  # once an IndexError mid-scoring
        make_tiny_model(tmp_path / "big", num_layers=1, num_texts=300, vocab_size=1024)
        m, tok = str(_without_tokenizer(model_dir, tmp_path / "bare")), str(tmp_path / "big")
    else:  # same size, other merges: once imported with ids the model never used
        make_tiny_model(tmp_path / "cd", task="countdown", num_layers=1, num_texts=300)
        tok = str(tmp_path / "cd")
    rc = _ingest(tmp_path / "s", "--score-with", m, *(["--tokenizer", tok] if tok else []))
    assert rc == 2
    err = _error(capsys)
    assert err.startswith(f"error: {flag} ")
    for needle in needles:
        assert needle in err, err
    assert "AutoModelForCausalLM" not in loads
    assert not (tmp_path / "s").exists()


def test_a_tokenizer_with_another_chat_template_is_the_models_own(tmp_path, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    scorer = ScoringModel(model_dir, tmp_path / "tok")
    assert scorer.tokenizer.chat_template == tok.chat_template


def test_a_row_longer_than_the_context_is_refused_before_scoring(tmp_path, loads, capsys):
    short = tmp_path / "short"
    make_tiny_model(short, num_layers=1, num_texts=300, max_position_embeddings=128)
    rows = tmp_path / "rows.jsonl"
    row = {"input": "user\nWhat is 2+3?\nassistant\n", "output": "5", "score": 1.0, "step": 1}
    long = {**row, "output": "2+3=5. " * 200}
    rows.write_text("".join(json.dumps(r) + "\n" for r in [row, row, long, row]))
    loads.clear()
    assert _ingest(tmp_path / "s", "--score-with", str(short), files=[rows]) == 2
    err = _error(capsys)
    assert f"{rows}:3" in err and "longer than the scoring model's context (128" in err
    assert "AutoModelForCausalLM" not in loads  # refused before the model was even loaded
    assert not (tmp_path / "s").exists()


def test_a_store_of_another_tokenizer_is_refused(tmp_path, model_dir, capsys):
    from transformers import AutoTokenizer

    store = tmp_path / "s"
    assert _ingest(store, "--score-with", str(model_dir)) == 0
    before = RolloutStore.open(store).version
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")  # same ids, other prompts: another fingerprint
    capsys.readouterr()
    assert _ingest(store, "--score-with", str(model_dir), "--tokenizer", str(tmp_path / "tok")) == 2
    err = _error(capsys)
    assert "tokenizer fingerprint(s)" in err and str(store) in err
    s = RolloutStore.open(store)
    assert s.version == before and s.count() == 5
    # The model's own tokenizer adds to it.
    assert _ingest(store, "--score-with", str(model_dir), "--on-duplicate", "skip") == 0
