"""The ``rolloutstore`` command line (store-only commands; the trainer's are ``rolloutstore-train``):
:mod:`.main` holds the parser and the query commands, :mod:`.ingest` ``init``/``ingest``,
:mod:`.maintain` ``stats`` to ``demo``, :mod:`.output` terminal/file output, :mod:`.base` the
parser class, the error policy both CLIs share, and opening a store argument."""

from rolloutstore.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
