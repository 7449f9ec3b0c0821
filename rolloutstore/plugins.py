"""Plugins: code outside rolloutstore (the trainer) that adds CLI commands or reward scorers.

rolloutstore never imports the trainer; packages register themselves through Python
entry points, declared in their ``pyproject.toml``::

    [project.entry-points."rolloutstore.commands"]
    trainer = "trainer.store_commands:register_commands"   # f(subparsers) adds subcommands

    [project.entry-points."rolloutstore.scorers"]
    trainer = "trainer.store_commands:resolve_scorer"      # f(spec, options, mode) -> Scorer|None

Entry points are read from the installed metadata. An editable install records them
when it is (re)installed, so a source checkout whose metadata predates a group (or a
worktree run with ``PYTHONPATH``) also reads the ``pyproject.toml`` beside this package;
its entries win by name.
"""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMANDS = "rolloutstore.commands"
SCORERS = "rolloutstore.scorers"

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def entry_points(group: str) -> list[md.EntryPoint]:
    """The entry points of ``group``: installed metadata, overlaid by the source tree's."""
    found = {ep.name: ep for ep in md.entry_points(group=group)}
    found.update({ep.name: ep for ep in _source_tree(group)})
    return [found[name] for name in sorted(found)]


def _source_tree(group: str) -> list[md.EntryPoint]:
    try:
        data = tomllib.loads(_PYPROJECT.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    project = data.get("project") or {}
    if project.get("name") != "rolloutstore":
        return []
    table = (project.get("entry-points") or {}).get(group) or {}
    return [md.EntryPoint(name, value, group) for name, value in table.items()]


def load(group: str) -> list[Callable[..., Any]]:
    """The loaded objects of ``group``; a plugin whose package is not installed is skipped."""
    out = []
    for ep in entry_points(group):
        try:
            out.append(ep.load())
        except ImportError:  # e.g. only rolloutstore is installed, without the trainer
            continue
    return out
