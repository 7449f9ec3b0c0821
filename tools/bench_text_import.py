"""What the ``ingest --from`` input checks cost: tokenizing long multi-turn chats with and
without them, side by side, and the whole import (model scoring included) for scale.

    python tools/bench_text_import.py [--chats 8] [--calls 10] [--rows 15] [--repeat 3]

The checks: every text field searched for the tokenizer's control tokens, every row hashed
for its content-derived rollout id (pass 1), each chat rendering's control tokens counted
(pass 2). "without" runs the same code with those three replaced by no-ops. Uses a tiny
1-layer model built in a temporary folder; prints seconds and the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolloutstore.io.interop import TextImporter, TextImportOptions  # noqa: E402
from trainer.models.tiny import make_tiny_model  # noqa: E402
from trainer.rollout.text_import import TextRowTransformer  # noqa: E402
from trainer.tasks.chat import encode_prompt  # noqa: E402


def _chats(n: int, calls: int, rows: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": "Add the numbers in the log."}]
        for _ in range(calls):
            x, y = rng.randrange(1000), rng.randrange(1000)
            log = " ".join(
                f"row {rng.randrange(1000)}: {rng.randrange(10**6)}" for _ in range(rows)
            )
            msgs += [{"role": "assistant", "content": f"<calc>{x}+{y}</calc>"},
                     {"role": "tool", "name": "calculator", "content": f"={x + y} {log}"}]  # fmt: skip
        msgs.append({"role": "assistant", "content": "done"})
        out.append({"messages": msgs, "reward": rng.random()})
    return out


def _tokenize(importer: TextImporter, rows: list[dict]) -> float:
    t0 = time.perf_counter()
    importer.scan(rows)
    for i, raw in enumerate(rows):
        importer.transformer._trajectory(dict(importer.normalize(raw, i)), i)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rows", type=int, default=15, help="log rows per tool reply")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows = _chats(a.chats, a.calls, a.rows, random.Random(0))
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", num_layers=1, num_texts=300, chat_template=True)
        checked = TextRowTransformer(TextImportOptions("openai", score_with=str(model)))
        bare = TextRowTransformer(TextImportOptions("openai", score_with=str(model)))
        bare.control_token_in = lambda text: None
        bare._encode_rendered = lambda text, i: encode_prompt(bare.tokenizer, text)
        with_checks = TextImporter(checked.options, checked)
        without = TextImporter(bare.options, bare)
        without.content_id = lambda row, occurrence, ordinal: "id"
        n_tokens = sum(len(checked._trajectory(dict(with_checks.normalize(r, 0)), 0)["completion_ids"])
                       for r in rows)  # fmt: skip
        best = {"with": float("inf"), "without": float("inf")}
        for _ in range(a.repeat):  # interleaved, best of: the machine is shared
            best["without"] = min(best["without"], _tokenize(without, rows))
            best["with"] = min(best["with"], _tokenize(with_checks, rows))
        with_checks.scan(rows)
        t0 = time.perf_counter()
        with_checks(rows, 0)
        whole = time.perf_counter() - t0
    print(json.dumps({"chats": a.chats, "completion_tokens": n_tokens}))
    print(f"tokenize without checks  {best['without']:.3f} s")
    print(
        f"tokenize with checks     {best['with']:.3f} s   ratio {best['with'] / best['without']:.2f}"
    )
    print(
        f"whole import (scoring)   {whole:.3f} s   checks' share {(best['with'] - best['without']) / whole:.1%}"
    )


if __name__ == "__main__":
    main()
