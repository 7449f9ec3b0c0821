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
rolloutstore schema
rolloutstore demo [RUN_DIR]

Other packages add commands through the ``rolloutstore.commands`` entry point (see
rolloutstore.plugins); the trainer adds ``generate`` and ``rescore``.

Errors: a user error (any RolloutStoreError, a bad argument, a missing file, or an
error a plugin declares user-facing, or any exception class with ``user_facing = True``)
prints one line ``error: ...`` to stderr and exits 2; ``--debug`` shows the traceback
instead. Ctrl-C interrupts a running query at once and exits 130 (``error: interrupted``).
A few ``evict`` option checks still exit 1 via SystemExit. Table output to a terminal
escapes control characters (``\x1b`` is shown as the four characters ``\x1b``); files
written with ``--out`` keep the stored text as is. Output paths inside a store are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from .errors import RolloutStoreError, UsageError
from .output import format_table, print_stats, write_result

# Predicates saying an exception is a user error (one line, no traceback); plugins add theirs.
_USER_ERRORS: list[Callable[[BaseException], bool]] = []


def register_user_errors(*predicates: Callable[[BaseException], bool] | type) -> None:
    """Declare more exceptions user-facing: exception classes, or ``exc -> bool`` predicates."""
    for p in predicates:
        if isinstance(p, type):
            _USER_ERRORS.append(lambda exc, cls=p: isinstance(exc, cls))
        else:
            _USER_ERRORS.append(p)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (printed as one line) rather than a bug."""
    if isinstance(exc, RolloutStoreError) or getattr(type(exc), "user_facing", False) is True:
        return True
    if isinstance(exc, OSError) and getattr(exc, "filename", None) is not None:
        return True  # a path the user gave does not exist / is a folder / is not readable
    return any(p(exc) for p in _USER_ERRORS)


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line in ``main``) instead of printing usage."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _store(path: str, *, create: bool = False):
    from .store import RolloutStore

    return RolloutStore.open(path, create=create)


def _param(s: str):
    from .cliargs import parse_scalar

    return parse_scalar(s)


def cmd_init(a) -> None:
    from .store import RolloutStore

    s = RolloutStore.open(a.store, create=True, embedding_dim=a.embedding_dim)
    print(
        f"store {s.uri}: version {s.version}, {s.count()} rollouts, embedding_dim {s.embedding_dim}"
    )


def cmd_ingest(a) -> None:
    from .ingest import ingest_files

    rename = {}
    for m in a.map:
        src, sep, dest = m.partition("=")
        if not sep or not src or not dest:
            raise UsageError(f"--map takes SRC=DEST (rename field SRC to DEST), got {m!r}")
        rename[src] = dest

    def report(r) -> None:
        skipped = f", {r.skipped} skipped as duplicates" if r.skipped else ""
        print(f"{r.path}: {r.rows} rollouts{skipped} (store version {r.version})")

    importer = _text_importer(a)
    store, results = ingest_files(
        a.store,
        a.files,
        rename=rename,
        progress=not a.quiet,
        on_duplicate=a.on_duplicate,
        on_result=report,
        importer=importer,
    )
    total, skipped = sum(r.rows for r in results), sum(r.skipped for r in results)
    dup = f" ({skipped} skipped: rollout_id already stored)" if skipped else ""
    print(f"ingested {total} rollouts{dup} into {store.uri}; store has {store.count()}")
    if importer is not None and importer.null_advantages:
        print(
            f"warning: {importer.null_advantages} rows have no advantage (--advantages none): "
            "stored as null, which replay trains as 0; use --advantages grpo|drgrpo or "
            "`rolloutstore rescore` to give them one",
            file=sys.stderr,
        )


def _text_importer(a):
    text_flags = [
        f
        for f, v in (
            ("--tokenizer", a.tokenizer),
            ("--score-with", a.score_with),
            ("--chat-template", a.chat_template),
            ("--ignore-unknown", a.ignore_unknown),
        )
        if v
    ]
    if a.source is None:
        if text_flags:
            raise UsageError(f"{', '.join(text_flags)} only apply with --from verl|trl|openai")
        return None
    from .interop import TextImporter, TextImportOptions, resolve_transformer

    try:
        options = TextImportOptions(
            source=a.source,
            tokenizer=a.tokenizer,
            score_with=a.score_with,
            chat_template=a.chat_template,
            advantages=a.advantages,
            ignore_unknown=a.ignore_unknown,
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            policy_version=a.policy_version,
            run_id=a.run_id,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if options.score_with is None:
        raise UsageError(
            f"--from {a.source}: these files carry text, not behaviour log-probs; pass "
            "--score-with MODEL_DIR to recompute them teacher-forced (and --tokenizer DIR "
            "if the model folder has no tokenizer)"
        )
    return TextImporter(options, resolve_transformer(options))


def cmd_sql(a) -> None:
    from .sql import run

    store = _store(a.store)
    if a.out:
        from .export import check_output_path

        check_output_path(a.out, what="--out file")  # before the query runs
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
    from .export import infer_format

    store = _store(a.store)
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
    )
    print(f"exported {r.rows} rows ({a.as_}, {fmt}) to {r.path}")


def cmd_sample(a) -> None:
    from .cliargs import dataclass_from_args
    from .replay import ReplayConfig, Selector

    try:
        cfg = dataclass_from_args(ReplayConfig, a)
    except (ValueError, TypeError) as exc:  # ReplayConfig names the offending option
        raise UsageError(str(exc)) from exc
    store = _store(a.store)
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


def cmd_stats(a) -> None:
    st = _store(a.store).stats()
    if a.json:
        print(json.dumps(st, default=str, indent=2))
    else:
        print_stats(st)


def cmd_versions(a) -> None:
    for v in _store(a.store).versions():
        print(f"{v['version']:>6}  {v['timestamp']}")


def cmd_compact(a) -> None:
    store = _store(a.store)
    older = (
        None if a.cleanup_older_than_hours is None else timedelta(hours=a.cleanup_older_than_hours)
    )
    print(json.dumps(store.compact(cleanup_older_than=older), indent=2))


def cmd_gc(a) -> None:
    store = _store(a.store)
    r = store.gc(min_age=timedelta(hours=a.min_age_hours), exports=a.exports, dry_run=a.dry_run)
    verb = "would remove" if a.dry_run else "removed"
    print(
        f"{verb} {len(r.removed)} unreferenced files ({r.bytes_removed} bytes); kept "
        f"{r.kept_young} younger than {a.min_age_hours} h; {r.versions_checked} versions checked"
    )


def cmd_evict(a) -> None:
    import dataclasses

    from .cliargs import dataclass_from_args
    from .retention import RetentionConfig, format_report

    options = sorted(f.name for f in dataclasses.fields(RetentionConfig) if f.name in vars(a))
    if options and not a.preserve_diversity:
        flags = ", ".join("--" + n.replace("_", "-") for n in options)
        raise SystemExit(f"error: {flags} only apply with --preserve-diversity")
    if a.preserve_diversity and a.keep is None:
        raise SystemExit("error: --preserve-diversity needs --keep N (the rows to keep)")
    try:
        diverse = dataclass_from_args(RetentionConfig, a) if a.preserve_diversity else False
        store = _store(a.store)
        older = None if a.older_than_hours is None else timedelta(hours=a.older_than_hours)
        r = store.evict(
            keep_last=a.keep,
            older_than=older,
            min_policy_version=a.min_policy_version,
            preserve_diversity=diverse,
        )
    except ValueError as exc:
        if isinstance(exc, RolloutStoreError):
            raise
        raise SystemExit(f"error: {exc}") from exc
    print(f"evicted {r.rows_deleted} rollouts, {r.rows_left} left (store version {r.version})")
    if r.coverage is not None:
        print(format_report(r.coverage))


def cmd_schema(a) -> None:
    from .schema import describe

    print(describe())


def cmd_demo(a) -> None:
    from .proxy import proxy_batches
    from .store import RolloutStore

    path = Path(a.run_dir) / "store"
    if path.exists():
        shutil.rmtree(path)
    store = RolloutStore.open(path)
    t0 = time.perf_counter()
    r = store.append(proxy_batches(a.rollouts, seed=a.seed, mean_completion_tokens=256))
    dt = time.perf_counter() - t0
    print(
        f"wrote {r.rows} seeded proxy rollouts to {path} in {dt:.1f}s (store version {r.version})\n"
    )
    print_stats(store.stats())
    query = (
        "SELECT policy_version, count(*) AS rollouts, round(avg(reward), 3) AS reward, "
        "round(avg(num_completion_tokens)) AS mean_len FROM rollouts "
        "WHERE reward > ? GROUP BY 1 ORDER BY 1"
    )
    print(f"\nexample query (parameter 0.5):\n  {query}\n")
    print(format_table(store.sql(query, [0.5])))
    print(f'\nnext: rolloutstore sql {path} "SELECT * FROM groups LIMIT 5"')


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="rolloutstore", description="Disk-backed rollout store for LLM RL.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_fill_commands(sub)
    _add_query_commands(sub)
    _add_maintenance_commands(sub)

    from .plugins import COMMANDS, load

    for register in load(COMMANDS):  # e.g. the trainer's generate and rescore
        register(sub)
    for p in sub.choices.values():  # --debug after the command too
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks of errors")  # fmt: skip
    return ap


# The subcommands' arguments, by group (argparse declarations: long, but flat).
def _add_fill_commands(sub) -> None:

    p = sub.add_parser("init", help="create an empty store")
    p.add_argument("store")
    p.add_argument("--embedding-dim", type=int, default=None, help="fixed at creation (default 64)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser(
        "ingest", help="append JSONL / JSONL.zst / Parquet files (one commit per file)"
    )
    p.add_argument("store")
    p.add_argument("files", nargs="+")
    p.add_argument("--map", action="append", default=[], metavar="SRC=DEST", help="rename a field")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--on-duplicate",
        choices=["error", "skip"],
        default="error",
        help="a rollout_id already stored: refuse the file (error) or leave the row out (skip)",
    )
    g = p.add_argument_group("text rollouts from other frameworks (rolloutstore.interop)")
    g.add_argument(
        "--from",
        dest="source",
        choices=["verl", "trl", "openai"],
        default=None,
        help="verl rollout_data_dir JSONL, TRL completions parquet, OpenAI chat JSONL",
    )
    g.add_argument(
        "--score-with",
        default=None,
        metavar="MODEL_DIR",
        help="recompute behaviour log-probs teacher-forced with this model",
    )
    g.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: --score-with)"
    )
    g.add_argument(
        "--chat-template",
        action="store_true",
        help="render text prompts as one user turn (messages always are)",
    )
    g.add_argument(
        "--advantages",
        choices=["grpo", "drgrpo", "none"],
        default="grpo",
        help="for rows without one: from the group's rewards, or none (null)",
    )
    g.add_argument("--ignore-unknown", action="store_true", help="drop fields the preset lacks")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature used")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold used")
    g.add_argument("--top-k", type=int, default=0, help="top-k used (0: none)")
    g.add_argument(
        "--policy-version",
        type=int,
        default=None,
        help="for every row (default: from the file's step, else 0)",
    )
    g.add_argument("--run-id", default=None, help="run_id for every row")  # fmt: skip
    p.set_defaults(func=cmd_ingest)


def _add_query_commands(sub) -> None:
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
        "export", help="stream rollouts, or SFT / DPO data from them, to Parquet, JSONL or HF"
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
    p.add_argument("--as", dest="as_", choices=["rollouts", "sft", "dpo"], default="rollouts")
    p.add_argument(
        "--min-reward",
        type=float,
        default=None,
        help="sft: every completion with reward >= R (default: the best per prompt)",
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
    from .cliargs import add_dataclass_args
    from .replay import ReplayConfig

    add_dataclass_args(p, ReplayConfig)
    p.set_defaults(func=cmd_sample)


def _add_maintenance_commands(sub) -> None:
    p = sub.add_parser("stats", help="rows, tokens, bytes/token, versions, rewards, reuse")
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("versions", help="list store versions")
    p.add_argument("store")
    p.set_defaults(func=cmd_versions)

    p = sub.add_parser("compact", help="merge small fragments; optionally drop old versions")
    p.add_argument("store")
    p.add_argument("--cleanup-older-than-hours", type=float, default=None)
    p.set_defaults(func=cmd_compact)

    p = sub.add_parser("gc", help="remove files killed appends/exports left that no version uses")
    p.add_argument("store")
    p.add_argument("--min-age-hours", type=float, default=1.0, help="only files older than this")
    p.add_argument("--exports", nargs="*", default=[], metavar="DIR", help="export folders")
    p.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("evict", help="delete rows by an explicit retention rule")
    p.add_argument("store")
    p.add_argument("--keep", type=int, default=None, help="keep the N most recent rollouts")
    p.add_argument("--older-than-hours", type=float, default=None)
    p.add_argument("--min-policy-version", type=int, default=None)
    p.add_argument(
        "--preserve-diversity",
        action="store_true",
        help="with --keep: spend a reserved share of N on older rows of prompts, embedding "
        "clusters and correct answers the newest rows miss; prints coverage vs FIFO",
    )
    from .cliargs import add_dataclass_args
    from .retention import RetentionConfig

    add_dataclass_args(p, RetentionConfig)
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("schema", help="print the rollout schema")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("demo", help="write seeded proxy rollouts and show stats and a query")
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--rollouts", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)


def _timeout_arg(p: argparse.ArgumentParser) -> None:
    from .sql import DEFAULT_TIMEOUT

    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"interrupt the query after S seconds (default {DEFAULT_TIMEOUT:g})",
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors print ``error: ...`` (one line) and return 2."""
    from .errors import QueryInterrupted
    from .sql import sigint_interrupts

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("ROLLOUTSTORE_DEBUG") == "1"
    try:
        args = build_parser().parse_args(argv)
        with sigint_interrupts():
            args.func(args)
    except (KeyboardInterrupt, QueryInterrupted):
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not is_user_error(exc):
            raise
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[6:].lstrip() if text.startswith("error:") else text


if __name__ == "__main__":
    sys.exit(main())
