"""Write a seeded, offline dataset of math word problems (question + answer) for the dataset task.

Usage: ``python tools/make_math_dataset.py OUT.jsonl --problems 2000 --seed 0`` (``.jsonl.zst``
and ``.parquet`` outputs work too). Each record is ``{"question": ..., "answer": ...,
"kind": ...}``; answers come in the forms a math reward must treat as equal to the model's:
integers (``12``), boxed integers (``\\boxed{7}``), fractions (``3/4`` or ``\\frac{3}{4}``)
and decimals (``1.5``). The same arguments always write the same file. Train on it with
``reward = "math"`` (examples/math.toml).

Difficulty: ``--kinds add,sub`` keeps only those kinds (of add, sub, mul, fraction, decimal) and
``--max-operand 9`` draws the operands of add / sub / mul from 1..9 (2..9 for mul) instead of
the default ranges (add 2..40, sub 10..60, mul 2..12 x 2..9); a tiny model learns single-digit
sums in minutes on a CPU (docs/results.md, "A math run that learns"). The defaults write the
files they always wrote.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "coins")
KINDS = ("add", "sub", "mul", "fraction", "decimal")


def _int_answer(rng: random.Random, value: int) -> str:
    return rf"\boxed{{{value}}}" if rng.random() < 0.5 else str(value)


def _frac_answer(rng: random.Random, value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    if rng.random() < 0.5:
        return rf"\frac{{{value.numerator}}}{{{value.denominator}}}"
    return f"{value.numerator}/{value.denominator}"


def _problem(
    rng: random.Random, kinds: tuple[str, ...] = KINDS, max_operand: int | None = None
) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(kinds)
    m = max_operand
    if kind == "add":
        a, b = (rng.randint(2, 40), rng.randint(2, 40)) if m is None else _two(rng, 1, m)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        answer = _int_answer(rng, a + b)
    elif kind == "sub":
        a = rng.randint(10, 60) if m is None else rng.randint(2, m)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        answer = _int_answer(rng, a - b)
    elif kind == "mul":
        a, b = (rng.randint(2, 12), rng.randint(2, 9)) if m is None else _two(rng, 2, m)
        q = f"{name} buys {b} boxes with {a} {item} in each. How many {item} is that in total?"
        answer = _int_answer(rng, a * b)
    elif kind == "fraction":
        n = rng.choice((2, 3, 4, 5, 6, 8, 10, 12))
        k = rng.randint(1, n - 1)
        q = (
            f"A cake is cut into {n} equal slices and {name} eats {k} of them. What fraction "
            "of the cake did they eat?"
        )
        answer = _frac_answer(rng, Fraction(k, n))
    else:
        pieces = rng.choice((2, 4, 5, 8))
        length = rng.randint(1, 20)
        while Fraction(length, pieces).denominator == 1:
            length = rng.randint(1, 20)
        q = (
            f"A ribbon {length} meters long is cut into {pieces} equal pieces. How many meters "
            "long is each piece?"
        )
        value = Fraction(length, pieces)
        answer = f"{float(value):g}"
    return {"question": q, "answer": answer, "kind": kind}


def _two(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    return rng.randint(lo, hi), rng.randint(lo, hi)


def make_problems(
    n: int, seed: int = 0, *, kinds: tuple[str, ...] = KINDS, max_operand: int | None = None
) -> list[dict[str, str]]:
    """``n`` problems of ``kinds``; the same arguments give the same list."""
    if n < 1:
        raise ValueError(f"problems must be >= 1, got {n}")
    kinds = tuple(kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if not kinds or unknown:
        raise ValueError(f"kinds must be some of {', '.join(KINDS)}, got {', '.join(kinds)}")
    if max_operand is not None and max_operand < 2:
        raise ValueError(f"max operand must be >= 2, got {max_operand}")
    rng = random.Random(f"math-dataset:{seed}")
    return [_problem(rng, kinds, max_operand) for _ in range(n)]


def write_dataset(
    path: str | Path,
    n: int,
    seed: int = 0,
    *,
    kinds: tuple[str, ...] = KINDS,
    max_operand: int | None = None,
) -> Path:
    """Write :func:`make_problems` to ``path`` (.jsonl, .jsonl.zst or .parquet)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = make_problems(n, seed, kinds=kinds, max_operand=max_operand)
    if path.name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    if path.name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor(level=6).compress(text.encode()))
    elif path.name.endswith((".jsonl", ".json", ".ndjson")):
        with path.open("w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        raise ValueError(f"{path}: use a .jsonl, .jsonl.zst or .parquet name")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output file: .jsonl, .jsonl.zst or .parquet")
    ap.add_argument("--problems", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, some of {','.join(KINDS)}"
    )
    ap.add_argument(
        "--max-operand", type=int, default=None,
        help="operands of add/sub/mul up to this (default: 2..40, 10..60, 2..12 x 2..9)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        path = write_dataset(
            args.out, args.problems, args.seed, kinds=kinds, max_operand=args.max_operand
        )
    except ValueError as exc:
        ap.error(str(exc))
    print(f"wrote {args.problems} problems to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
