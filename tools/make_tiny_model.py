"""Write a tiny random Qwen2 model + task-trained BPE tokenizer to PATH, fully offline.

Usage: ``python tools/make_tiny_model.py PATH --task arith --seed 0`` (see ``--help`` for sizes).
The result loads with ``transformers`` and vLLM (head_dim 64); identical arguments give
byte-identical files. Implemented by :func:`trainer.models.tiny.make_tiny_model`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Running as a script puts tools/ (not the repo root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.models.tiny import make_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="output directory (created if missing)")
    parser.add_argument("--task", default="arith", help="task whose text trains the tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--num-kv-heads", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument(
        "--task-kwargs",
        type=json.loads,
        default=None,
        help='JSON object, e.g. \'{"path": "p.jsonl"}\'',
    )
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="give the tokenizer a simple chat template (as an instruct model's has)",
    )
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(
            args.path,
            task=args.task,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            vocab_size=args.vocab_size,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings,
            task_kwargs=args.task_kwargs,
            chat_template=args.chat_template,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
