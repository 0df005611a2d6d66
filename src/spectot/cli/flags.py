"""argparse flags from the typed config dataclasses, and back.

A field ``max_new_tokens: int`` becomes ``--max-new-tokens`` with its help text; ``Literal`` types
become choices; ``bool`` fields become ``--x / --no-x``; ``positional=True`` makes a positional argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, defaults: Mapping[str, Any] | None = None) -> None:
    """The dataclass's fields as flags; ``defaults`` replaces some fields' defaults for this command (its help
    shows them)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        default = (defaults or {}).get(f.name, default)
        kw: dict[str, Any] = {"dest": f.name, "help": f"{f.metadata.get('help', '')} (default: {default!r})"}
        if f.metadata.get("positional"):
            group.add_argument(f.name, help=f.metadata.get("help", ""), type=str)
            continue
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["default"] = default
        elif f.metadata.get("action") == "append":
            kw.update(action="append", default=None)
        else:
            args = [a for a in get_args(kind) if a is not type(None)]
            if get_origin(kind) is Literal:
                kw["choices"] = list(args)
            elif args:  # Optional[X]
                kind = args[0]
            kw.update(type=kind if kind in (int, float, str) else str, default=default)
        group.add_argument(_flag(f), **kw)


def from_flags(ns: argparse.Namespace, cls: type[T]) -> T:
    """Build the config from parsed flags; its own validation raises with a fix-it message."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(ns, f.name)
        if f.metadata.get("action") == "append":
            value = tuple(value or ())
        values[f.name] = value
    return cls(**values)
