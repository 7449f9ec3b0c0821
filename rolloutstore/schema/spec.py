"""The rollout schema, built from ``schemas/rollout.v2.json`` (the single source of truth).

The JSON file names every column with its Arrow type, nullability, default and a
one-line description. This module turns it into a ``pyarrow.Schema`` for a given
embedding dimension, carrying the schema version and the dimension as schema
metadata so that every Lance dataset records what wrote it.

New stores are written with :data:`SCHEMA_VERSION` (2: multi-turn trajectories). Stores
written with an older version (``rollout.v1.json``) still open; how their rows are read
and appended is :mod:`rolloutstore.schema_compat`, and ``rolloutstore migrate`` upgrades
them (:mod:`rolloutstore.store.migrate`). A newer version than this code knows is refused.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from rolloutstore.errors import SchemaError, SchemaVersionError

SCHEMA_VERSION = 2
# Versions this code opens (and appends to); older ones are read as the current one.
READABLE_VERSIONS = (1, 2)
DEFAULT_EMBEDDING_DIM = 64
# The JSON lives in the repo's top-level schemas/ and is installed as rolloutstore/schemas/
# (package data, pyproject's package-dir). A source checkout (PYTHONPATH, editable
# install) reads the top-level folder; an installed wheel reads the packaged copy.
PACKAGE_SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"
SOURCE_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"

META_VERSION = b"rolloutstore.schema_version"
META_EMBEDDING_DIM = b"rolloutstore.embedding_dim"

_SCALARS: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int8": pa.int8(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "timestamp[us, UTC]": pa.timestamp("us", tz="UTC"),
}


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    type: str
    nullable: bool
    description: str
    group: str = ""
    default: str | None = None
    encoding: dict | None = None


@functools.cache
def spec(version: int = SCHEMA_VERSION) -> dict:
    """The parsed JSON specification of ``version``."""
    name = f"rollout.v{version}.json"
    path = schema_dir() / name
    if not path.is_file():
        raise SchemaVersionError(
            f"expected the schema file for version {version} at {path}, found none; "
            "reinstall rolloutstore (the wheel ships it as package data)"
        )
    return json.loads(path.read_text())


def schema_dir() -> Path:
    """The folder holding ``rollout.v*.json``: packaged copy if installed, else the repo's."""
    marker = f"rollout.v{SCHEMA_VERSION}.json"
    if (PACKAGE_SCHEMA_DIR / marker).is_file():
        return PACKAGE_SCHEMA_DIR
    return SOURCE_SCHEMA_DIR


SCHEMA_DIR = schema_dir()


def columns(version: int = SCHEMA_VERSION) -> tuple[ColumnSpec, ...]:
    return tuple(ColumnSpec(**c) for c in spec(version)["columns"])


def _arrow_type(name: str, embedding_dim: int, encoding: dict | None) -> pa.DataType:
    name = name.strip()
    if name in _SCALARS:
        return _SCALARS[name]
    m = re.fullmatch(r"list<(.+)>", name)
    if m:
        meta = {f"lance-encoding:{k}": str(v) for k, v in (encoding or {}).items()}
        # Lance reads per-column compression from the list's child field.
        item = _arrow_type(m.group(1), embedding_dim, None)
        return pa.list_(pa.field("item", item, metadata=meta or None))
    m = re.fullmatch(r"struct<(.+)>", name)
    if m:
        fields = []
        for part in _split_fields(m.group(1)):
            fname, sep, ftype = part.partition(":")
            if not sep:
                raise SchemaError(f"struct field {part!r} in {name!r} has no type")
            fields.append(pa.field(fname.strip(), _arrow_type(ftype, embedding_dim, None)))
        return pa.struct(fields)
    m = re.fullmatch(r"fixed_size_list<(.+)>\[embedding_dim\]", name)
    if m:
        return pa.list_(_SCALARS[m.group(1)], embedding_dim)
    raise SchemaError(f"unknown type {name!r} in the schema file")


def _split_fields(text: str) -> list[str]:
    """``a: int32, b: list<struct<x: int8, y: int8>>`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _schema(cols, metadata: dict[bytes, bytes] | None, embedding_dim: int) -> pa.Schema:
    fields = [
        pa.field(
            c.name,
            _arrow_type(c.type, embedding_dim, c.encoding),
            nullable=c.nullable,
            metadata={b"description": c.description.encode()},
        )
        for c in cols
    ]
    return pa.schema(fields, metadata=metadata)


def check_embedding_dim(embedding_dim: int) -> None:
    """Refuse an embedding dimension that is not a positive int."""
    if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
        raise SchemaError(f"embedding_dim must be a positive int, got {embedding_dim!r}")


def rollout_schema(
    embedding_dim: int = DEFAULT_EMBEDDING_DIM, version: int = SCHEMA_VERSION
) -> pa.Schema:
    """Arrow schema of the ``rollouts`` table (schema ``version``) for a store of
    ``embedding_dim``."""
    check_embedding_dim(embedding_dim)
    meta = {
        META_VERSION: str(version).encode(),
        META_EMBEDDING_DIM: str(embedding_dim).encode(),
    }
    return _schema(columns(version), meta, embedding_dim)


@functools.cache
def table_schema(name: str) -> pa.Schema:
    """Arrow schema of an auxiliary table (``usage``, ``lineage``, ``rewards``) in the schema file."""
    cols = [ColumnSpec(**c) for c in spec()["tables"][name]]
    return _schema(cols, {META_VERSION: str(SCHEMA_VERSION).encode()}, 1)


def read_metadata(schema: pa.Schema) -> tuple[int, int]:
    """(schema_version, embedding_dim) recorded in a dataset's schema; checks the version."""
    meta = schema.metadata or {}
    if META_VERSION not in meta:
        raise SchemaError(
            "this Lance dataset was not written by rolloutstore (no schema version in its "
            "metadata); ingest its rows with `rolloutstore ingest` instead"
        )
    version = _positive_int(meta, META_VERSION)
    if version not in READABLE_VERSIONS:
        raise SchemaVersionError(
            f"store was written with rollout schema v{version}, this rolloutstore reads "
            f"v{READABLE_VERSIONS[0]} to v{SCHEMA_VERSION}; update rolloutstore "
            "(pip install -U rolloutstore) to open it"
        )
    if META_EMBEDDING_DIM not in meta:
        return version, DEFAULT_EMBEDDING_DIM
    return version, _positive_int(meta, META_EMBEDDING_DIM)


def _positive_int(meta: dict, key: bytes) -> int:
    """The positive integer ``meta[key]`` (ASCII digits) of a dataset's schema metadata."""
    text = meta[key].decode("utf-8", "replace")
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        raise SchemaError(
            f"the store's schema metadata records {key.decode()} = {text[:40]!r}, expected "
            "a positive integer: it was damaged or written by another program; restore the "
            "store from a copy, or set that metadata key with Lance"
        )
    return int(text)


def describe() -> str:
    """Human-readable column list (for `rolloutstore schema`)."""
    lines = [f"rollout schema v{SCHEMA_VERSION}"]
    for c in columns():
        null = "null" if c.nullable else "required"
        lines.append(f"  {c.name:<22} {c.type:<40} {null:<8} {c.description}")
    return "\n".join(lines)
