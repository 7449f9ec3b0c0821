"""``rolloutstore-train``: run, resume and inspect replay-RL training runs.

rolloutstore-train train CONFIG.toml [--set run.steps=20 ...]
rolloutstore-train train CONFIG.toml --set 'run.mode="async"' --actors 2
rolloutstore-train resume RUN_DIR [--set run.steps=N ...]
rolloutstore-train config --defaults        # every config key, its default and help (TOML)
rolloutstore-train compare RUN_A RUN_B    # same draws per step and final weights? (exit 1: no)
torchrun --nproc-per-node 2 -m trainer train CONFIG.toml   # distributed learners (sync mode)
rolloutstore-train actor RUN_DIR [--actor-id K] [--learner-weights DIR]  # async; learner starts it
rolloutstore-train actor CONFIG.toml --store s3://B/store --learner-weights s3://B/weights  # remote
python -m trainer train CONFIG.toml
rolloutstore-train generate STORE --model DIR|tiny --task arith   # scored rollouts into a store
rolloutstore-train rescore STORE --task NAME                      # a new reward version
rolloutstore-train ingest STORE FILE --from verl|trl|openai --score-with MODEL_DIR
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path

from rolloutstore.cli.base import Parser, add_debug_flag, run_main
from rolloutstore.cli.base import is_user_error as base_is_user_error
from trainer.config import ConfigError, TrainConfig
from trainer.errors import TrainerError


def _apply_sets(data: dict, sets: list[str]) -> dict:
    """``--set SECTION.KEY=VALUE`` (VALUE in TOML, else a bare string) into ``data``; a dotted
    KEY reaches into nested tables (``task.options.reward=math``, ``replay.control.enabled``,
    ``model.lora.rank``), creating them when absent."""
    for item in sets:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ConfigError(
                f"--set takes SECTION.KEY=VALUE (SECTION.TABLE.KEY=VALUE for a nested key, e.g. "
                f"task.options.reward=math), got {item!r}"
            )
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # absent, or null in a run.json ([model.lora] off)
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"--set {key}: {'.'.join(parts[: depth + 1])} is {child!r}, not a table; "
                    f"set it whole (--set {'.'.join(parts[: depth + 1])}=...) or name a table"
                )
            node = child
        node[parts[-1]] = value
    return data


def _summary(result) -> None:
    if os.environ.get("RANK", "0") != "0":
        return  # torchrun: rank 0 reports for all learner ranks
    store = result.store
    print(f"\nrun folder   {result.run_dir}")
    print(f"store        {store}")
    if result.first_eval is not None and result.last_eval is not None:
        print(
            f"eval reward  {result.first_eval:.3f} -> {result.last_eval:.3f} "
            f"after {result.steps} learner steps"
        )
    print(f"metrics      {result.run_dir / 'metrics.jsonl'} (TensorBoard: {result.run_dir / 'tb'})")
    if result.timing:
        mu = f", mu {result.timing['mu']:.3g}" if "mu" in result.timing else ""
        print(
            f"time         {result.run_dir / 'summary.json'} ({result.timing['wall_seconds']:.0f} s{mu})"
        )
    print(
        "look inside: rolloutstore sql " + str(store) + ' "SELECT policy_version, count(*) AS n, '
        'round(avg(reward), 3) AS reward FROM rollouts GROUP BY 1 ORDER BY 1"'
    )


def cmd_train(a) -> None:
    from trainer.run.sync import train

    data = tomllib.loads(Path(a.config).read_text())
    cfg = TrainConfig.from_dict(_apply_sets(data, a.set))
    if a.actors is not None:
        cfg = cfg.with_run(actors=a.actors)
    _summary(train(cfg, progress=not a.quiet))


def cmd_actor(a) -> None:
    from trainer.run.actor import run_actor

    source = a.source
    if Path(source).is_file():  # a TOML config: a standalone actor
        cfg = TrainConfig.from_dict(_apply_sets(tomllib.loads(Path(source).read_text()), a.set))
        source = cfg.with_run(actors=a.actors) if a.actors is not None else cfg
    elif a.set:
        raise ConfigError("--set applies to a CONFIG.toml; a run folder's config is fixed")
    options = None
    if a.storage_option:
        options = {}
        for item in a.storage_option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--storage-option takes KEY=VALUE, got {item!r}")
            options[key] = value
    run_actor(
        source,
        a.actor_id,
        weights_dir=a.learner_weights,
        rounds_ahead=a.rounds_ahead,
        store_uri=a.store,
        storage_options=options,
        state_dir=a.state_dir,
        max_rounds=a.max_rounds,
    )


def cmd_resume(a) -> None:
    from trainer.run.resume import effective_config, read_run_meta
    from trainer.run.sync import train

    # The config the run last ran with (its newest resume's), plus this resume's --set.
    data = _apply_sets(effective_config(read_run_meta(a.run_dir)), a.set)
    data.setdefault("run", {})["dir"] = str(a.run_dir)
    cfg = TrainConfig.from_dict(data)
    _summary(train(cfg, resume=True, progress=not a.quiet))


def cmd_config(a) -> None:
    from trainer.config import defaults_toml

    print(defaults_toml(), end="")


def cmd_compare(a) -> None:
    from trainer.run.compare import compare_runs

    result = compare_runs(a.run_a, a.run_b)
    print(result.line())
    if result.difference is not None:
        raise SystemExit(1)


def cmd_plot(a) -> None:
    from trainer.run.plot import plot_run

    for path in plot_run(a.run_dir):
        print(path)


def build_parser() -> argparse.ArgumentParser:
    from trainer.store_commands import register_commands

    ap = Parser(prog="rolloutstore-train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_train(sub)
    _add_resume(sub)
    _add_actor(sub)
    p = sub.add_parser("plot", help="PNGs of reward, entropy, staleness vs step and tokens")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("config", help="print every config key with its default and help")
    p.add_argument(
        "--defaults",
        action="store_true",
        required=True,
        help="every key of every table, its default and help, as a TOML file",
    )
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "compare",
        help="two runs' per-step draws (usage) and final weights: identical, or the first "
        "difference (exit 1)",
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.set_defaults(func=cmd_compare)
    register_commands(sub)  # generate, rescore, ingest
    add_debug_flag(ap, sub)
    return ap


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="start a run from a TOML config")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--actors", type=int, default=None, metavar="N", help="async: actor processes (run.actors)"
    )
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_train)


def _add_resume(sub) -> None:
    p = sub.add_parser("resume", help="continue a run from its newest checkpoint")
    p.add_argument("run_dir")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="e.g. run.steps=80 to train further; a changed [optim] or [model] key applies "
        "from the next step or is refused, naming why",
    )
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_resume)


def _add_actor(sub) -> None:
    p = sub.add_parser(
        "actor",
        help="async mode: one actor process (the learner starts them; run more on other machines)",
    )
    p.add_argument(
        "source", metavar="RUN_DIR|CONFIG", help="the learner's run folder, or a TOML config"
    )
    p.add_argument("--actor-id", type=int, default=0, metavar="K")
    p.add_argument(
        "--learner-weights",
        default=None,
        metavar="URI",
        help="published weights: a folder or s3://... (default: $ROLLOUTSTORE_WEIGHTS_URI, "
        "else RUN_DIR/weights)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="URI",
        help="the shared rollout store (default: $ROLLOUTSTORE_STORE_URI, else RUN_DIR/store)",
    )
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="object-store option (Lance keys, e.g. aws_endpoint=...); default: "
        "$ROLLOUTSTORE_STORAGE_OPTIONS (JSON) and the AWS_* environment",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="this actor's next round and downloaded weights (default: [run].dir/actors)",
    )
    p.add_argument("--max-rounds", type=int, default=None, metavar="N", help="exit after N rounds")
    p.add_argument(
        "--actors",
        type=int,
        default=None,
        metavar="N",
        help="CONFIG: actors on this machine (run.actors; sets the torch threads per actor)",
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--rounds-ahead",
        type=int,
        default=2,
        metavar="N",
        help="rounds per policy version before waiting for newer weights",
    )
    p.set_defaults(func=cmd_actor)


def is_user_error(exc: BaseException) -> bool:
    """rolloutstore's error policy, plus the trainer's refusals: TrainerError, and the
    ValueErrors its modules raise on bad arguments (an unknown task, a bad sampling value)."""
    if base_is_user_error(exc) or isinstance(exc, TrainerError | FileNotFoundError):
        return True
    return isinstance(exc, ValueError) and type(exc).__module__.split(".")[0] == "trainer"


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors print ``error: ...`` (one line) and return 2."""
    return run_main(
        build_parser,
        argv,
        user_error=is_user_error,
        interrupted="interrupted; resume with `rolloutstore-train resume RUN_DIR`",
    )
