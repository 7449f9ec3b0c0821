"""The ``rolloutstore`` command line: create, fill, inspect and maintain a store.

rolloutstore init STORE [--embedding-dim 64]
rolloutstore ingest STORE FILE... [--map SRC=DEST] [--on-duplicate error|skip]
rolloutstore sql STORE "SELECT ..." [--param V ...] [--format table|csv|json|parquet] [--out F]
rolloutstore stats STORE [--json]
rolloutstore versions STORE
rolloutstore compact STORE [--cleanup-older-than-hours H]
rolloutstore gc STORE [--min-age-hours 1] [--exports DIR ...] [--dry-run]
rolloutstore evict STORE (--keep N | --older-than-hours H | --min-policy-version V)
rolloutstore evict STORE --keep N --preserve-diversity [--reserve F] [--clusters K]
rolloutstore rescore STORE --task NAME [--task-option K=V] [--where EXPR --param V]
rolloutstore schema
rolloutstore demo [RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from .errors import RolloutStoreError


def _store(path: str, *, create: bool = False):
    from .store import RolloutStore

    return RolloutStore.open(path, create=create)


def _cell(v) -> str:
    if isinstance(v, list):
        head = ", ".join(_cell(x) for x in v[:4])
        return f"[{head}{', ...' if len(v) > 4 else ''}] ({len(v)})" if len(v) > 4 else f"[{head}]"
    if isinstance(v, float):
        return f"{v:.6g}"
    s = "NULL" if v is None else str(v)
    return s if len(s) <= 48 else s[:45] + "..."


def format_table(table: pa.Table, max_rows: int = 50) -> str:
    """A plain-text grid of the first ``max_rows`` rows."""
    names = table.column_names
    rows = [[_cell(v) for v in r.values()] for r in table.slice(0, max_rows).to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    line = "  ".join(n.ljust(w) for n, w in zip(names, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if table.num_rows > max_rows:
        out.append(f"... {table.num_rows - max_rows} more rows (use --format/--out for all)")
    out.append(f"({table.num_rows} rows)")
    return "\n".join(out)


def write_result(table: pa.Table, fmt: str, out: str | None) -> None:
    """Write a query result; files are written here, never by SQL."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if fmt == "parquet":
        if not out:
            raise SystemExit("--format parquet needs --out FILE")
        pq.write_table(table, out, compression="zstd")
        return
    if fmt == "table":
        text = format_table(table, max_rows=table.num_rows if out else 50) + "\n"
    elif fmt == "json":
        text = "".join(json.dumps(r, default=str) + "\n" for r in table.to_pylist())
    else:  # csv
        import io

        buf = io.BytesIO()
        flat = pa.table(
            {
                n: (
                    c
                    if not pa.types.is_nested(c.type)
                    else pa.array([json.dumps(v) for v in c.to_pylist()])
                )
                for n, c in zip(table.column_names, table.columns)
            }
        )
        pcsv.write_csv(flat, buf)
        text = buf.getvalue().decode()
    if out:
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)


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

    def report(r) -> None:
        skipped = f", {r.skipped} skipped as duplicates" if r.skipped else ""
        print(f"{r.path}: {r.rows} rollouts{skipped} (store version {r.version})")

    rename = dict(m.split("=", 1) for m in a.map)
    store, results = ingest_files(
        a.store,
        a.files,
        rename=rename,
        progress=not a.quiet,
        on_duplicate=a.on_duplicate,
        on_result=report,
    )
    total, skipped = sum(r.rows for r in results), sum(r.skipped for r in results)
    dup = f" ({skipped} skipped: rollout_id already stored)" if skipped else ""
    print(f"ingested {total} rollouts{dup} into {store.uri}; store has {store.count()}")


def cmd_sql(a) -> None:
    store = _store(a.store)
    if a.version is not None:
        store = store.checkout(a.version)
    params = [_param(p) for p in a.param] or None
    write_result(store.sql(a.query, params), a.format, a.out)


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
    )
    print(f"exported {r.rows} rows ({a.as_}, {fmt}) to {r.path}")


def cmd_sample(a) -> None:
    from .cliargs import dataclass_from_args
    from .replay import ReplayConfig, Selector

    cfg = dataclass_from_args(ReplayConfig, a)
    store = _store(a.store)
    sel = Selector(store, cfg, run_id=a.run_id, record_usage=a.record_usage)
    if a.explain:
        print(sel.explain(a.learner_version))
        return
    s = sel.sample(a.batch_size, a.learner_version, max_tokens=a.max_tokens)
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


def print_stats(st: dict) -> None:
    gib = st["bytes_on_disk"]
    print(f"store      {st['uri']} (version {st['version']}, {st['fragments']} fragments)")
    print(
        f"rollouts   {st['rows']:,} in {st['groups']:,} groups, {st['prompts']:,} prompts, {st['runs']} runs"
    )
    print(
        f"tokens     {st['tokens']:,} ({st['prompt_tokens']:,} prompt + {st['completion_tokens']:,} completion)"
    )
    if gib is not None:
        bpt = st["bytes_per_token"]
        print(f"on disk    {gib / 2**20:,.1f} MiB" + (f", {bpt:.2f} bytes/token" if bpt else ""))
    if st["by_policy_version"]:
        print("policy_version  rollouts  reward_mean")
        for r in st["by_policy_version"]:
            mean = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.4f}"
            print(f"{r['policy_version']:>14}  {r['rollouts']:>8}  {mean:>11}")
    if st["reuse"]:
        print("uses  rollouts")
        for r in st["reuse"]:
            print(f"{r['uses']:>4}  {r['rollouts']:>8}")


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


def cmd_rescore(a) -> None:
    from .rescore import RescoreError

    options = {}
    for opt in a.task_option:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise RescoreError(f"--task-option takes KEY=VALUE, got {opt!r}")
        options[key.replace("-", "_")] = _param(value)
    r = _store(a.store).rescore(
        a.task,
        task_options=options,
        where=a.where,
        params=[_param(p) for p in a.param],
        from_task=a.from_task,
        advantage_mode=a.advantage_mode,
        note=a.note,
        progress=not a.quiet,
    )
    print(r.line())


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
    ap = argparse.ArgumentParser(
        prog="rolloutstore", description="Disk-backed rollout store for LLM RL."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

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
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("sql", help="run a DuckDB query over views rollouts, usage, groups")
    p.add_argument("store")
    p.add_argument("query")
    p.add_argument("--param", action="append", default=[], help="value for the next ? placeholder")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    p.add_argument("--out", help="write the result to this file")
    p.add_argument("--version", type=int, default=None, help="query a past store version")
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
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sample", help="draw one replay batch and print it (or its SQL)")
    p.add_argument("store")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="fill a token budget instead")
    p.add_argument("--learner-version", type=int, required=True)
    p.add_argument("--run-id", default="default")
    p.add_argument("--record-usage", action="store_true", help="log the draw in the usage table")
    p.add_argument("--explain", action="store_true", help="print the SQL instead of sampling")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table")
    p.add_argument("--out")
    from .cliargs import add_dataclass_args
    from .replay import ReplayConfig

    add_dataclass_args(p, ReplayConfig)
    p.set_defaults(func=cmd_sample)

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
    from .retention import RetentionConfig

    add_dataclass_args(p, RetentionConfig)
    p.set_defaults(func=cmd_evict)

    try:  # generation lives in the trainer package (transformers/torch, vLLM optional)
        from trainer.rollout.pipeline import add_generate_parser
    except ImportError:  # pragma: no cover - the trainer package ships with rolloutstore
        pass
    else:
        add_generate_parser(sub)

    p = sub.add_parser(
        "rescore", help="re-score stored rollouts under a new reward_version (tokens untouched)"
    )
    p.add_argument("store")
    p.add_argument("--task", required=True, help="task whose verifier scores (arith, ...)")
    p.add_argument("--task-option", action="append", default=[], metavar="K=V", help="task option")
    p.add_argument(
        "--from-task", default=None, help="rows' task column to re-score (default: --task)"
    )
    p.add_argument(
        "--where",
        default=None,
        help="filter over rollouts_scored picking groups, e.g. 'reward > ?'",
    )
    p.add_argument("--param", action="append", default=[], help="value for the next ? in --where")
    p.add_argument("--advantage-mode", choices=["grpo", "drgrpo"], default="grpo")
    p.add_argument("--note", default=None, help="free-form note stored with the new version")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_rescore)

    p = sub.add_parser("schema", help="print the rollout schema")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("demo", help="write seeded proxy rollouts and show stats and a query")
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--rollouts", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (RolloutStoreError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
