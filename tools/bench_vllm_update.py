"""vLLM weight update on CPU: in-place update + verification against an engine restart.

    python tools/bench_vllm_update.py                  # 5 in-place updates, 2 restarts
    python tools/bench_vllm_update.py --updates 10 --restarts 1 --eager

Builds the tiny random Qwen2 model for ``arith`` (:func:`trainer.models.tiny.make_tiny_model`) in a
temporary folder, starts a :class:`trainer.rollout.vllm.VLLMGenerator` as the trainer does
(compiled unless ``--eager``), then times, side by side, the two ways to give it new weights:

- *in place*: ``VLLMGenerator.update_weights(state_dict)`` with a perturbed state dict, split
  into *load* (serialise, send, layerwise reload + re-pack, prefix-cache reset) and *verify*
  (sample 2 x 2 completions and recompute their log-probs with transformers);
- *restart*: publish the weights as a folder, close the engine, start a new one from it and
  run the same verification (what the trainer did before in-place updates).

Every in-place update must verify (max |vLLM - teacher-forced| log-prob <= 1e-3, else the
script fails). Prints the mean seconds of each and the restart / in-place ratio.
Scripts that start vLLM must do it under ``if __name__ == "__main__":`` (spawned workers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.models.load import load_model  # noqa: E402
from trainer.models.tiny import make_tiny_model  # noqa: E402
from trainer.rollout.hf import max_logprob_gap  # noqa: E402
from trainer.rollout.vllm import VERIFY_PROMPTS, VLLMGenerator  # noqa: E402
from trainer.rollout.weights import publish_weights  # noqa: E402


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=5, help="in-place updates to time")
    ap.add_argument("--restarts", type=int, default=2, help="engine restarts to time")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    args = ap.parse_args()
    if args.updates < 1 or args.restarts < 1:
        ap.error("--updates and --restarts must be >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = make_tiny_model(
            root / "tiny", hidden_size=args.hidden_size, num_layers=args.num_layers
        )
        model, _ = load_model(tiny)
        state = model.state_dict()
        opts = {"enforce_eager": args.eager}
        t0 = time.perf_counter()
        gen = VLLMGenerator(tiny, **opts)
        first_start = time.perf_counter() - t0
        loads, verifies, gaps = [], [], []
        try:
            for i in range(args.updates):
                state = perturbed(state, seed=i)
                u = gen.update_weights(state, policy_version=i + 1)
                loads.append(u.update_seconds)
                verifies.append(u.verify_seconds)
                gaps.append(u.gap)
            restarts = []
            for j in range(args.restarts):
                state = perturbed(state, seed=1000 + j)
                model.load_state_dict(state)
                t0 = time.perf_counter()
                folder = publish_weights(root / "weights", 100 + j, model, template=tiny)
                gen.close()
                gen = VLLMGenerator(folder, policy_version=100 + j, **opts)
                rows = gen.generate(list(VERIFY_PROMPTS), group_size=2, max_tokens=16, seed=0)
                gap = max_logprob_gap(model, rows)
                restarts.append(time.perf_counter() - t0)
                if not gap <= 1e-3:
                    raise SystemExit(f"restarted engine does not match its weights: {gap:.2e}")
        finally:
            gen.close()

    in_place = [a + b for a, b in zip(loads, verifies)]
    mode = "eager" if args.eager else "compiled"
    print(f"tiny Qwen2 ({args.num_layers} layers, hidden {args.hidden_size}), {mode} engine")
    print(f"first engine start              {first_start:8.2f} s")
    print(f"in-place load (x{len(loads)})             {statistics.mean(loads):8.3f} s")
    print(f"in-place verify                 {statistics.mean(verifies):8.3f} s")
    print(f"in-place update + verify        {statistics.mean(in_place):8.3f} s")
    print(f"restart + verify (x{len(restarts)})          {statistics.mean(restarts):8.2f} s")
    print(f"max log-prob gap after updates  {max(gaps):8.1e}")
    print(
        f"restart / in-place              {statistics.mean(restarts) / statistics.mean(in_place):8.0f}x"
    )


if __name__ == "__main__":
    main()
