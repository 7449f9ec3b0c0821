"""Generation + reward figures of a tool config's warm-started policy against its no-tool twin.

    python tools/tool_arith_eval.py examples/tool_arith.toml [--warm-steps N] [--prompts N]
        [--tool-demos F] [--seeds 0,1]

For each seed, builds the config's tiny model (as a run would, trainer/run/setup.py
prepare_model), then warm-starts two copies with the config's [run] warm_start_steps and
warm_start_lr: the *baseline* on direct answers only (the config without tools, one turn)
and the *tool* policy on the task's tool demonstrations ([task].tool_demos of them call the
calculator). Both are evaluated like the training loop's eval (trainer/run/setup.py evaluate:
the eval prompts, one sample each, the [generation] sampling settings, transformers
backend), and the tool policy's trajectories are broken down: how often it calls the tool,
how often the call is well formed, and its accuracy with and without a call. No RL step is
taken (training end to end needs the schema-v2 store). Prints one JSON line per policy and
seed, then a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import TrainConfig
from trainer.models.load import load_model
from trainer.rollout.hf import HFGenerator
from trainer.rollout.multiturn import generate_for_task
from trainer.run.setup import prepare_model, warm_start
from trainer.tasks.chat import render_prompts
from trainer.tasks.parsing import last_int


def variant(cfg: TrainConfig, tools: bool, tool_demos: float | None) -> TrainConfig:
    """``cfg`` with its tools (and ``tool_demos``), or without tools and with one turn."""
    task, gen = cfg.task, cfg.generation
    if tools:
        if tool_demos is not None:
            task = dataclasses.replace(task, tool_demos=tool_demos)
    else:
        task = dataclasses.replace(task, tools=())
        gen = dataclasses.replace(gen, max_turns=1, max_total_tokens=0)
    return dataclasses.replace(cfg, task=task, generation=gen)


def measure(cfg: TrainConfig, model_dir: Path, out: Path, warm_steps: int, n: int) -> dict:
    """Warm-start a copy of ``model_dir`` under ``cfg`` and evaluate it on ``n`` prompts."""
    task = cfg.task.build()
    model, tok = load_model(model_dir)
    t0 = time.perf_counter()
    losses = warm_start(
        model, tok, task, steps=warm_steps, lr=cfg.run.warm_start_lr, seed=cfg.run.seed
    )
    warm_s = time.perf_counter() - t0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    gen = HFGenerator(out)
    prompts = render_prompts(
        tok, task.make_eval_prompts(n, seed=10_000_019 + cfg.run.seed), task.chat_template
    )
    g = cfg.generation
    t0 = time.perf_counter()
    rows = generate_for_task(
        gen, task, [p.prompt_text for p in prompts], max_turns=g.max_turns,
        max_total_tokens=g.max_total_tokens,
        **g.sampling(group_size=1, seed=cfg.run.seed + 99).kwargs(),
    )  # fmt: skip
    gen_s = time.perf_counter() - t0
    results = [task.reward(p, r["completion_text"]) for p, r in zip(prompts, rows)]
    reward = np.array([x.reward for x in results])
    called = np.array([any(t["role"] == "tool" for t in r.get("turns") or []) for r in rows])
    errors = np.array(["<result>error</result>" in r["completion_text"] for r in rows])
    exact, copied = _call_figures(task, prompts, rows, called)
    out_figures: dict[str, Any] = {
        "tools": list(cfg.task.tools),
        "tool_demos": cfg.task.tool_demos if cfg.task.tools else 0.0,
        "warm_start_steps": warm_steps,
        "warm_start_final_loss": round(float(np.mean(losses[-10:])), 4),
        "prompts": n,
        "eval_reward": round(float(reward.mean()), 4),
        "tool_call_rate": round(float(called.mean()), 4),
        "tool_error_rate": round(float(errors[called].mean()), 4) if called.any() else None,
        "call_copies_expression": exact,
        "answer_copies_result": copied,
        "accuracy_with_call": round(float(reward[called].mean()), 4) if called.any() else None,
        "accuracy_without_call": (
            round(float(reward[~called].mean()), 4) if (~called).any() else None
        ),
        "finish_reasons": {
            str(k): int(v)
            for k, v in zip(*np.unique([r["finish_reason"] for r in rows], return_counts=True))
        },
        "mean_completion_tokens": round(
            float(np.mean([len(r["completion_ids"]) for r in rows])), 1
        ),
        "warm_start_s": round(warm_s, 1),
        "eval_generation_s": round(gen_s, 1),
        "examples": [r["completion_text"] for r in rows[:3]],
    }
    return out_figures


def _call_figures(task, prompts, rows, called) -> tuple[float | None, float | None]:
    """Among trajectories with a call: the share whose first call is the prompt's expression,
    and the share whose answer (the model's last integer) is the first result's value."""
    if not called.any():
        return None, None
    exact = copied = 0
    for p, r, c in zip(prompts, rows, called):
        if not c:
            continue
        text = r["completion_text"]
        call = re.search(r"<calc>(.*?)</calc>", text)
        result = re.search(r"<result>(.*?)</result>", text)
        exact += bool(call and call.group(1) == p.meta.get("expression"))
        answer = last_int(task.env.model_text(text))
        value = result.group(1).removeprefix("=") if result else None
        copied += bool(answer is not None and str(answer) == value)
    n = int(called.sum())
    return round(exact / n, 4), round(copied / n, 4)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--warm-steps", type=int, help="override [run].warm_start_steps")
    ap.add_argument("--prompts", type=int, help="override [eval].prompts")
    ap.add_argument("--tool-demos", type=float, help="override [task].tool_demos")
    ap.add_argument("--warm-lr", type=float, help="override [run].warm_start_lr")
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (model + warm start)")
    ap.add_argument("--policies", default="baseline,tool", help="which policies to measure")
    args = ap.parse_args(argv)
    base_cfg = TrainConfig.load(args.config)
    if not base_cfg.task.tools:
        ap.error(f"{args.config} has no [task].tools")
    if args.warm_lr is not None:
        base_cfg = base_cfg.with_run(warm_start_lr=args.warm_lr)
    steps = args.warm_steps if args.warm_steps is not None else base_cfg.run.warm_start_steps
    wanted = args.policies.split(",")
    n = args.prompts or base_cfg.eval.prompts
    summary: dict[str, list[float]] = {"baseline": [], "tool": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        cfg = base_cfg.with_run(seed=seed)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seed=seed))
        with tempfile.TemporaryDirectory(prefix="tool-arith-eval-") as tmp:
            model_dir = prepare_model(cfg, Path(tmp))
            for name, tools in (("baseline", False), ("tool", True)):
                if name not in wanted:
                    continue
                v = variant(cfg, tools, args.tool_demos)
                figures = measure(v, model_dir, Path(tmp) / name, steps, n)
                print(json.dumps({"policy": name, "seed": seed, **figures}), flush=True)
                summary[name].append(figures["eval_reward"])
    for name, rewards in summary.items():
        if not rewards:
            continue
        print(
            f"{name}: eval reward {np.mean(rewards):.3f} over seeds {args.seeds} "
            f"({', '.join(f'{r:.3f}' for r in rewards)}) after {steps} warm-start steps "
            f"(lr {base_cfg.run.warm_start_lr}), no RL"
        )


if __name__ == "__main__":
    main()
