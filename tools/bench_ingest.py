"""Scoring speed of ``rolloutstore-train ingest --from verl --score-with MODEL``: the old
row-at-a-time path vs the batched one, beside the model's own raw forward on the same tokens.

    python tools/bench_ingest.py                      # 800 verl rows, a 1-layer tiny model
    python tools/bench_ingest.py --rows 2000 --model DIR --batch-tokens 16384 --threads 1

Three timings over the same text rows (tokenizing included in the first two):

- ``row-at-a-time``: what ingest did before batching: per row, tokenize, then one unpadded
  forward (:func:`trainer.rollout.hf.teacher_forced_logprobs`);
- ``batched``: the ingest transformer as it runs now (:class:`TextRowTransformer`:
  tokenize and check every row, then length-bucketed padded batches);
- ``raw forward``: only ``model(input_ids, attention_mask)`` on the batched path's own padded
  batches (no tokenizing, no log-softmax, no gather): the ceiling the batched path can reach.

Each is run ``--repeats`` times, interleaved, and the best kept (the machine may be shared:
the load average is printed). Printed: rows/s of each, batched / row-at-a-time, and batched /
raw forward. It also checks the two paths' log-probs agree (max abs diff).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# Running as a script puts tools/ (not the repo root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rolloutstore.io.interop import TextImporter, TextImportOptions  # noqa: E402
from trainer.rollout.hf import teacher_forced_logprobs  # noqa: E402
from trainer.rollout.scoring import ScoringConfig, length_batches  # noqa: E402
from trainer.rollout.text_import import TextRowTransformer  # noqa: E402


def verl_rows(n: int, seed: int = 0) -> list[dict]:
    """verl ``rollout_data_dir`` rows: arithmetic prompts, answers of 5 to ~150 tokens."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        steps = " ".join(f"{a}+{b}={a + b}." for _ in range(rng.randint(1, 16)))
        rows.append({"input": f"user\nWhat is {a}+{b}? Answer with a number.\nassistant\n",
                     "output": f"{steps} The answer is {a + b}", "gts": str(a + b),
                     "score": float(rng.random() < 0.5), "step": 1 + i // 64})  # fmt: skip
    return rows


def row_at_a_time(tr: TextRowTransformer, rows: list[dict]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i, row in enumerate(rows):
            t = tr._single(dict(row), i)
            out.append(teacher_forced_logprobs(tr.model, t["prompt_ids"], t["completion_ids"], 1.0))
    return out


def raw_forward(model, pairs: list[tuple[list[int], list[int]]], batch_tokens: int) -> None:
    lengths = [len(p) + len(c) for p, c in pairs]
    with torch.no_grad():
        for batch in length_batches(lengths, batch_tokens):
            width = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, : lengths[i]] = torch.tensor([*pairs[i][0], *pairs[i][1]])
                mask[b, : lengths[i]] = 1
            model(input_ids=ids, attention_mask=mask)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=800)
    ap.add_argument("--model", default=None, help="model folder (default: a 1-layer tiny model)")
    ap.add_argument("--batch-tokens", type=int, default=ScoringConfig().batch_tokens)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model
        if model_dir is None:
            from trainer.models.tiny import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", num_layers=1, num_texts=300)
        options = TextImportOptions(source="verl", score_with=str(model_dir))
        tr = TextRowTransformer(options, ScoringConfig(batch_tokens=a.batch_tokens))
        importer = TextImporter(options, tr)
        raw = verl_rows(a.rows)
        importer.scan(raw)
        text_rows = [importer.normalize(r, i) for i, r in enumerate(raw)]
        new = importer(raw, 0)  # loads the model; warms up
        pairs = [(r["prompt_ids"], r["completion_ids"]) for r in new]
        old = row_at_a_time(tr, text_rows[:8])
        gap = max(
            float((torch.tensor(n["behavior_logprobs"]) - o).abs().max())
            for n, o in zip(new, old)
        )  # fmt: skip
        t_old = t_new = t_raw = float("inf")
        for _ in range(a.repeats):  # interleaved: a load change hits all three alike
            t_old = min(t_old, best(lambda: row_at_a_time(tr, text_rows), 1))
            t_new = min(t_new, best(lambda: importer(raw, 0), 1))
            t_raw = min(t_raw, best(lambda: raw_forward(tr.model, pairs, a.batch_tokens), 1))
    tokens = sum(len(p) + len(c) for p, c in pairs)
    n = a.rows
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{n} verl rows, {tokens:,} tokens (mean {tokens / n:.0f}/row); model {model_dir}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, load average {load}; batch_tokens {a.batch_tokens}")  # fmt: skip
    print(f"{'path':<16}{'rows/s':>10}{'tokens/s':>12}")
    for name, t in (("row-at-a-time", t_old), ("batched", t_new), ("raw forward", t_raw)):
        print(f"{name:<16}{n / t:>10.0f}{tokens / t:>12,.0f}")
    print(f"batched / row-at-a-time: {t_old / t_new:.1f}x")
    print(f"batched / raw forward:   {t_raw / t_new:.2f} (1.00 = only the model's own time)")
    print(f"max |batched - row-at-a-time| log-prob: {gap:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
