"""Config fields and the options built from them, for both packages: ``help_field`` declares a
dataclass field with its help text; ``add_dataclass_args`` turns the fields into argparse
options (so the CLI, the TOML config and their defaults are one source); ``parse_scalar``
reads ``--param`` values."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, get_args, get_origin


def parse_scalar(s: str) -> Any:
    """An int, else a float, else the string itself (for CLI parameter values)."""
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def _bool_or_str(s: str) -> bool | str:
    """A CLI value of a Literal mixing bools and strings: true / false as bools."""
    return {"true": True, "false": False}.get(s.lower(), s)


def _unwrap_optional(tp):
    args = [a for a in get_args(tp) if a is not type(None)]
    if (
        get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None))
        and len(args) == 1
    ):
        return args[0]
    return tp


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (its factory's value for mutable ones; None when required)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls,
    *,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    flags: dict[str, str] | None = None,
    metavars: dict[str, str] | None = None,
) -> None:
    """One ``--field-name`` option per dataclass field, typed from its annotation, its help
    the field's help text plus its default. Options left off the command line are absent from
    the namespace, so :func:`dataclass_from_args` gives them the dataclass default: the CLI
    and the config cannot disagree on one.

    ``only`` / ``skip`` pick fields; ``flags`` renames (``{"name": "--task"}``); ``metavars``
    names values in the usage line."""
    hints = typing.get_type_hints(cls)
    flags, metavars = flags or {}, metavars or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        tp = _unwrap_optional(hints[f.name])
        flag = flags.get(f.name, "--" + f.name.replace("_", "-"))
        default = field_default(f)
        # argparse %-formats help strings: a literal % in the text must be doubled.
        text = f.metadata.get("help", "").replace("%", "%%")
        help_ = f"{text} (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if f.name in metavars:
            kw["metavar"] = metavars[f.name]
        if tp is bool:
            kw.pop("metavar", None)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif get_origin(tp) is Literal:
            choices = list(get_args(tp))
            if any(isinstance(c, bool) for c in choices):  # e.g. Literal["auto", True, False]
                kw["type"] = _bool_or_str
            parser.add_argument(flag, choices=choices, **kw)
        elif tp is tuple or get_origin(tp) is tuple:
            parser.add_argument(flag, nargs="+", type=parse_scalar, **kw)
        elif tp in (int, float, str):
            parser.add_argument(flag, type=tp, **kw)
        else:
            raise TypeError(f"no CLI mapping for {cls.__name__}.{f.name}: {tp!r}")


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    """Build ``cls`` from the options given on the command line (others keep defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)
    return cls(**values)


def help_field(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field with ``help`` metadata: the config docs and the CLI's ``--help``
    are read from it (mutable defaults get a factory)."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": text}, **kw
        )
    return dataclasses.field(default=default, metadata={"help": text}, **kw)
