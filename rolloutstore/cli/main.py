"""The ``rolloutstore`` command line: create, fill, inspect and maintain a store.

rolloutstore init STORE [--embedding-dim 64]
rolloutstore ingest STORE FILE... [--map SRC=DEST] [--on-duplicate error|skip]
                    [--from verl|trl|openai --score-with MODEL_DIR [--tokenizer DIR]
                     [--chat-template] [--advantages grpo|drgrpo|none] [--ignore-unknown]]
rolloutstore sql STORE "SELECT ..." [--param V ...] [--format table|csv|json|parquet] [--out F]
                 [--timeout S]
rolloutstore stats STORE [--json]
rolloutstore versions STORE
rolloutstore compact STORE [--cleanup-older-than-hours H]
rolloutstore gc STORE [--min-age-hours 1] [--exports DIR ...] [--dry-run]
rolloutstore evict STORE (--keep N | --older-than-hours H | --min-policy-version V)
rolloutstore evict STORE --keep N --preserve-diversity [--reserve F] [--clusters K]
rolloutstore migrate STORE
rolloutstore schema
rolloutstore demo [RUN_DIR]

Commands that need a model (``generate``, ``rescore`` by task, ``ingest --from ...
--score-with``) are ``rolloutstore-train``'s; named here, they say so in one line.

This module holds the parser, the error handling and the query commands (``sql``,
``export``, ``sample``); :mod:`rolloutstore.cli_ingest` holds ``init`` and ``ingest``,
:mod:`rolloutstore.cli_maintain` the rest.

Errors follow :mod:`rolloutstore.cli.base` (one line and exit 2 for a user error,
``--debug`` for the traceback); Ctrl-C interrupts a running query at once and exits 130.
Table output to a terminal
escapes control characters (``\x1b`` is shown as the four characters ``\x1b``); files
written with ``--out`` keep the stored text as is. Output paths inside a store are refused.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import pyarrow as pa

from rolloutstore.cli.base import MOVED, Parser, add_debug_flag, open_store, run_main
from rolloutstore.cli.ingest import add_fill_commands
from rolloutstore.cli.maintain import add_maintenance_commands
from rolloutstore.cli.output import write_result
from rolloutstore.errors import QueryError, UsageError


def _param(s: str):
    from rolloutstore.options import parse_scalar

    return parse_scalar(s)


def cmd_sql(a) -> None:
    from rolloutstore.query.sql import run

    store = open_store(a.store)
    if a.out:
        from rolloutstore.io.outputs import output_target

        output_target(a.out, what="--out file")  # checked before the query runs
    if a.version is not None:
        known = [v["version"] for v in store.versions()]
        if a.version not in known:
            shown = ", ".join(map(str, known[-10:]))
            raise UsageError(
                f"store {store.uri} has no version {a.version}; its versions end with {shown} "
                "(see `rolloutstore versions`)"
            )
        store = store.checkout(a.version)
    params = [_param(p) for p in a.param] or None
    con = store.connect()
    try:
        table = run(con, a.query, params, timeout=a.timeout)
    finally:
        con.close()
    write_result(table, a.format, a.out)


def cmd_export(a) -> None:
    from rolloutstore.io.export import infer_format

    store = open_store(a.store)
    fmt = a.format or infer_format(a.out)
    columns = a.columns.split(",") if a.columns is not None else None
    r = store.export(
        a.out,
        format=fmt,
        where=a.where,
        params=[_param(p) for p in a.param] or None,
        columns=columns,
        as_=a.as_,
        min_reward=a.min_reward,
        min_margin=a.min_margin,
        progress=not a.quiet,
        timeout=a.timeout,
        tokenizer=a.tokenizer,
        keep_duplicates=a.keep_duplicates,
    )
    print(f"exported {r.rows} rows ({a.as_}, {fmt}) to {r.path}")


def cmd_sample(a) -> None:
    from rolloutstore.options import dataclass_from_args
    from rolloutstore.replay import ReplayConfig, Selector

    params = [_param(p) for p in a.param]
    if a.where_params is not None:
        if params:
            raise UsageError("give the --where values as --param V (once per ?), not both ways")
        print("warning: --where-params is deprecated; use --param V, once per ?", file=sys.stderr)
        params = [_param(p) for p in a.where_params]
    try:
        cfg = dataclass_from_args(ReplayConfig, a, where_params=tuple(params))
    except (ValueError, TypeError) as exc:  # ReplayConfig names the offending option
        raise UsageError(str(exc)) from exc
    store = open_store(a.store)
    if not a.explain:
        if a.batch_size is None and a.max_tokens is None:
            raise UsageError("sample needs --batch-size N or --max-tokens T")
        for flag, v in (("--batch-size", a.batch_size), ("--max-tokens", a.max_tokens)):
            if v is not None and v < 1:
                raise UsageError(f"{flag} must be >= 1, got {v}")
    sel = Selector(store, cfg, run_id=a.run_id, record_usage=a.record_usage)
    if a.explain:
        print(sel.explain(a.learner_version))
        return
    step = a.learner_step if a.learner_step is not None else _next_step(store, a.run_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = sel.sample(a.batch_size, a.learner_version, max_tokens=a.max_tokens, learner_step=step)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    rows = store.take_rows(
        s.row_addresses,
        columns=["rollout_id", "prompt_id", "prompt_text", "reward", "policy_version"],
    )
    prompt = [
        t if t is not None else p
        for t, p in zip(rows["prompt_text"].to_pylist(), rows["prompt_id"].to_pylist())
    ]
    out = pa.table(
        {
            "rollout_id": rows["rollout_id"],
            "prompt": pa.array(prompt, pa.string()),
            "reward": rows["reward"],
            "policy_version": rows["policy_version"],
            "staleness": pa.array(s.staleness),
            "weight": pa.array(s.weights),
        }
    )
    write_result(out, a.format, a.out)


def _next_step(store, run_id: str) -> int:
    """One past the newest step ``run_id`` logged: each CLI draw is a new learner step, so
    ``--max-uses`` counts uses across calls (a rerun of step 0 would count as one use)."""
    t = store.sql("SELECT max(learner_step) AS s FROM usage WHERE run_id = ?", [run_id])
    last = t["s"][0].as_py()
    return 0 if last is None else int(last) + 1


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="rolloutstore", description="Disk-backed rollout store for LLM RL.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_fill_commands(sub)  # init, ingest: cli/ingest.py
    _add_query_commands(sub)
    add_maintenance_commands(sub)  # stats ... demo: cli/maintain.py
    for name, where in MOVED.items():
        # No options of its own: whatever follows (--help too) gets the one-line answer.
        p = sub.add_parser(name, help=f"moved: {where}", add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs="*")
        p.set_defaults(func=lambda a, name=name, where=where: _moved(name, where))
    add_debug_flag(ap, sub)
    return ap


def _moved(name: str, where: str) -> None:
    raise UsageError(
        f"`rolloutstore {name}` needs a model and moved to the trainer's command: run "
        f"`{where} ...` with the same arguments"
    )


def _add_query_commands(sub) -> None:
    """``sql``, ``export`` and ``sample`` (argparse declarations: long, but flat)."""
    p = sub.add_parser("sql", help="run a DuckDB query over views rollouts, usage, groups")
    p.add_argument("store")
    p.add_argument("query")
    p.add_argument("--param", action="append", default=[], help="value for the next ? placeholder")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    p.add_argument("--out", help="write the result to this file")
    p.add_argument("--version", type=int, default=None, help="query a past store version")
    _timeout_arg(p)
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser(
        "export",
        help="stream rollouts, or SFT / DPO / chat data from them, to Parquet, JSONL or HF",
    )
    p.add_argument("store")
    p.add_argument("out", help="output file (a folder for --format hf)")
    p.add_argument(
        "--format",
        choices=["parquet", "jsonl", "jsonl.zst", "hf"],
        default=None,
        help="default: from OUT's extension",
    )
    p.add_argument(
        "--where", default=None, help="filter expression over rollouts, e.g. 'reward > ?'"
    )
    p.add_argument("--param", action="append", default=[], help="value for the next ? in --where")
    p.add_argument("--columns", default=None, help="comma-separated output columns (default all)")
    p.add_argument(
        "--as", dest="as_", choices=["rollouts", "sft", "dpo", "messages"], default="rollouts"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="messages: decode each turn of multi-turn rows with this tokenizer folder",
    )
    p.add_argument(
        "--min-reward",
        type=float,
        default=None,
        help="sft: every completion with reward >= R (default: each prompt's best "
        "completions, when their reward is > 0)",
    )
    p.add_argument(
        "--keep-duplicates",
        action="store_true",
        help="sft: keep repeated (prompt, completion) pairs (default: each pair once, its "
        "highest reward)",
    )
    p.add_argument(
        "--min-margin",
        type=float,
        default=None,
        help="dpo: least chosen - rejected reward per group (default 0.5)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _timeout_arg(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sample", help="draw one replay batch and print it (or its SQL)")
    p.add_argument("store")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="fill a token budget instead")
    p.add_argument("--learner-version", type=int, required=True)
    p.add_argument("--run-id", default="default")
    p.add_argument("--record-usage", action="store_true", help="log the draw in the usage table")
    p.add_argument(
        "--learner-step",
        type=int,
        default=None,
        help="step to draw (default: one past the newest step --run-id logged)",
    )
    p.add_argument("--explain", action="store_true", help="print the SQL instead of sampling")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    p.add_argument("--out")
    from rolloutstore.options import add_dataclass_args
    from rolloutstore.replay import ReplayConfig

    add_dataclass_args(p, ReplayConfig, skip=("where_params",))
    p.add_argument("--param", action="append", default=[], help="value for the next ? in --where")
    p.add_argument(
        "--where-params",
        nargs="+",
        default=None,
        metavar="V",
        help="deprecated: the --where values in one list; use --param V per ? (as sql, export)",
    )
    p.set_defaults(func=cmd_sample)


def _seconds(s: str) -> float:
    from rolloutstore.query.limits import check_timeout

    try:
        return check_timeout(float(s))
    except ValueError as exc:  # argparse names the option: "argument --timeout: ..."
        raise argparse.ArgumentTypeError(
            str(exc) if isinstance(exc, QueryError) else f"expected seconds, got {s!r}"
        ) from None


def _timeout_arg(p: argparse.ArgumentParser) -> None:
    from rolloutstore.query.sql import DEFAULT_TIMEOUT

    p.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"interrupt the query after S seconds (default {DEFAULT_TIMEOUT:g})",
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors print ``error: ...`` (one line) and return 2."""
    return run_main(build_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
