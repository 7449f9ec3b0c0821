"""The ``rolloutstore`` commands that inspect and maintain a store: ``stats``, ``versions``,
``compact``, ``gc``, ``evict``, ``migrate``, ``schema`` and ``demo``; their arguments and
handlers."""

from __future__ import annotations

import json
import shutil
import time
from datetime import timedelta
from pathlib import Path

from rolloutstore.cli.base import open_store
from rolloutstore.cli.output import format_table, print_stats
from rolloutstore.errors import RolloutStoreError, UsageError


def cmd_stats(a) -> None:
    st = open_store(a.store).stats()
    if a.json:
        print(json.dumps(st, default=str, indent=2))
    else:
        print_stats(st)


def cmd_versions(a) -> None:
    for v in open_store(a.store).versions():
        print(f"{v['version']:>6}  {v['timestamp']}")


def cmd_compact(a) -> None:
    store = open_store(a.store)
    older = (
        None if a.cleanup_older_than_hours is None else timedelta(hours=a.cleanup_older_than_hours)
    )
    print(json.dumps(store.compact(cleanup_older_than=older), indent=2))


def cmd_gc(a) -> None:
    store = open_store(a.store)
    r = store.gc(min_age=timedelta(hours=a.min_age_hours), exports=a.exports, dry_run=a.dry_run)
    verb = "would remove" if a.dry_run else "removed"
    print(
        f"{verb} {len(r.removed)} unreferenced files ({r.bytes_removed} bytes); kept "
        f"{r.kept_young} younger than {a.min_age_hours} h; {r.versions_checked} versions checked"
    )


def cmd_evict(a) -> None:
    import dataclasses

    from rolloutstore.options import dataclass_from_args
    from rolloutstore.retention.policy import RetentionConfig, format_report

    options = sorted(f.name for f in dataclasses.fields(RetentionConfig) if f.name in vars(a))
    if options and not a.preserve_diversity:
        flags = ", ".join("--" + n.replace("_", "-") for n in options)
        raise UsageError(f"{flags} only apply with --preserve-diversity")
    if a.preserve_diversity and a.keep is None:
        raise UsageError("--preserve-diversity needs --keep N (the rows to keep)")
    try:
        diverse = dataclass_from_args(RetentionConfig, a) if a.preserve_diversity else False
        store = open_store(a.store)
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
        raise UsageError(str(exc)) from exc
    print(f"evicted {r.rows_deleted} rollouts, {r.rows_left} left (store version {r.version})")
    if r.coverage is not None:
        print(format_report(r.coverage))


def cmd_migrate(a) -> None:
    from rolloutstore.store.migrate import migrate

    print(migrate(open_store(a.store)).describe())


def cmd_schema(a) -> None:
    from rolloutstore.schema.spec import describe

    print(describe())


def cmd_demo(a) -> None:
    from rolloutstore.facade import RolloutStore
    from rolloutstore.io.proxy import proxy_batches

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


def add_maintenance_commands(sub) -> None:
    """``stats`` to ``demo`` (argparse declarations: long, but flat)."""
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
    from rolloutstore.options import add_dataclass_args
    from rolloutstore.retention.policy import RetentionConfig

    add_dataclass_args(p, RetentionConfig)
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser(
        "migrate", help="upgrade a store to the current rollout schema (v1 -> v2, one commit)"
    )
    p.add_argument("store")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("schema", help="print the rollout schema")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("demo", help="write seeded proxy rollouts and show stats and a query")
    p.add_argument("run_dir", nargs="?", default="runs/demo")
    p.add_argument("--rollouts", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)
