"""The commands that create and fill a store: ``init``, and ``ingest`` of rollout files; their
arguments and handlers. ``ingest --from verl|trl|openai --score-with MODEL`` (other frameworks'
text rollouts, :mod:`rolloutstore.io.interop`) needs a model to recompute log-probs: the same
parser is registered by ``rolloutstore-train ingest``, which passes the row transformer."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from rolloutstore.cli.base import store_path
from rolloutstore.errors import UsageError


def cmd_init(a) -> None:
    from rolloutstore.facade import RolloutStore

    s = RolloutStore.open(a.store, create=True, embedding_dim=a.embedding_dim)
    print(
        f"store {s.uri}: version {s.version}, {s.count()} rollouts, embedding_dim {s.embedding_dim}"
    )


def cmd_ingest(a, transformer: Callable[[Any, Any], Any] | None = None) -> None:
    """``ingest``; ``transformer(options, args)`` (the trainer's) turns text rows into token
    rows. Every input is checked before the transformer loads its model: the files, the flags,
    the folders, the store's tokenizer."""
    from rolloutstore.io.ingest import check_file, ingest_files

    for f in a.files:
        check_file(f)

    rename = {}
    for m in a.map:
        src, sep, dest = m.partition("=")
        if not sep or not src or not dest:
            raise UsageError(f"--map takes SRC=DEST (rename field SRC to DEST), got {m!r}")
        rename[src] = dest

    def report(r) -> None:
        skipped = f", {r.skipped} skipped as duplicates" if r.skipped else ""
        print(f"{r.path}: {r.rows} rollouts{skipped} (store version {r.version})")

    importer = _text_importer(a, transformer)
    uri = store_path(a.store)
    fingerprint = getattr(importer.transformer, "fingerprint", None) if importer else None
    if fingerprint is not None:
        _check_store_tokenizer(uri, fingerprint)
    store, results = ingest_files(
        uri,
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
            "`rolloutstore-train rescore` to give them one",
            file=sys.stderr,
        )


def _text_importer(a, transformer):
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
    from rolloutstore.io.interop import TextImporter, TextImportOptions

    if transformer is None:
        raise UsageError(
            f"ingest --from {a.source} tokenizes text and recomputes log-probs with a model: run "
            "`rolloutstore-train ingest ...` with the same arguments"
        )

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
    return TextImporter(options, transformer(options, a))


def _check_store_tokenizer(uri: str, fingerprint: str) -> None:
    """Refuse text rows tokenized differently from the rows already stored: replay would mix
    vocabularies (as ``[run] sources`` refuses). Rows without a fingerprint are not counted."""
    from rolloutstore.errors import StoreNotFoundError
    from rolloutstore.facade import RolloutStore

    try:
        store = RolloutStore.open(uri, create=False)
    except StoreNotFoundError:
        return  # ingest creates it
    found = store.sql(
        "SELECT DISTINCT tokenizer_fingerprint AS f FROM rollouts "
        "WHERE tokenizer_fingerprint IS NOT NULL AND tokenizer_fingerprint <> ?",
        [fingerprint],
    )["f"].to_pylist()
    if found:
        raise UsageError(
            f"store {uri} holds rows of tokenizer fingerprint(s) {sorted(found)}, these would "
            f"carry {fingerprint!r} (the tokenizer of --tokenizer / --score-with): rollouts are "
            "reused only with the same tokenizer; ingest into another store, or score with the "
            "model and tokenizer the stored rows came from"
        )


def add_fill_commands(sub) -> None:
    """``init`` and ``ingest``."""
    p = sub.add_parser("init", help="create an empty store")
    p.add_argument("store")
    p.add_argument("--embedding-dim", type=int, default=None, help="fixed at creation (default 64)")
    p.set_defaults(func=cmd_init)
    add_ingest_parser(sub)


def add_ingest_parser(sub, transformer: Callable[[Any, Any], Any] | None = None):
    """``ingest`` (argparse declarations: long, but flat); ``transformer``: see cmd_ingest.
    Returns the text-import argument group (the trainer adds its scoring flags to it)."""
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
    g = p.add_argument_group(
        "text rollouts from other frameworks (rolloutstore-train ingest: needs --score-with)"
    )
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
    p.set_defaults(func=functools.partial(cmd_ingest, transformer=transformer))
    return g
