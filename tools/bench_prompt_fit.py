"""What [generation] prompt_overflow costs a round: fit_prompts beside encoding the prompts once.

``fit_prompts`` (trainer/tasks/chat.py) encodes every prompt once more before sampling; an
overlong prompt under ``truncate_left`` costs a binary search of encodes. The script times,
with a real tokenizer, encoding ``--prompts`` task prompts, checking them, and cutting one long
prompt to ``--limit`` - ``--max-tokens`` tokens, and prints the ratios side by side.

    python tools/bench_prompt_fit.py                       # SmolLM2's tokenizer (.cache/smollm2/fp32)
    python tools/bench_prompt_fit.py --tokenizer DIR --prompts 1024
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.tasks import Prompt, get_task  # noqa: E402
from trainer.tasks.chat import encode_prompt, fit_prompts  # noqa: E402


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=".cache/smollm2/fp32")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--limit", type=int, default=4096, help="the model's context")
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    prompts = get_task("arith").make_prompts(args.prompts, seed=0)
    enc = _seconds(lambda: [encode_prompt(tok, p.prompt_text) for p in prompts])
    fit = _seconds(
        lambda: fit_prompts(tok, prompts, max_tokens=args.max_tokens, limit=8192, policy="error")
    )
    rng = random.Random(0)
    text = " ".join(f"note {rng.randrange(1000)}: {rng.randrange(10**6)}" for _ in range(700))
    long = Prompt(text + "\nQ: 2+3 =", "5")
    n = len(encode_prompt(tok, long.prompt_text))
    one = _seconds(lambda: encode_prompt(tok, long.prompt_text))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        out = fit_prompts(
            tok, [long], max_tokens=args.max_tokens, limit=args.limit, policy="truncate_left"
        )
        cut = time.perf_counter() - t
    kept = len(encode_prompt(tok, out.prompts[0].prompt_text))
    print(f"{'':34}{'seconds':>10}{'x encode':>10}")
    print(f"{f'encode {args.prompts} prompts':34}{enc:10.4f}{1.0:10.2f}")
    print(f"{f'fit_prompts (error) {args.prompts}':34}{fit:10.4f}{fit / enc:10.2f}")
    print(f"{f'encode one {n}-token prompt':34}{one:10.4f}{1.0:10.2f}")
    print(f"{f'truncate_left it to {kept} tokens':34}{cut:10.4f}{cut / one:10.2f}")
    print(f"(budget {args.limit - args.max_tokens} tokens: {args.limit} - max_tokens)")


if __name__ == "__main__":
    main()
