"""Settings plumbing every layer shares (standard library only): value checks whose errors name the
flag or key, the one strict JSON loader of odb's config files, and a dataclass's attribute
docstrings (read from its source), from which ``--help`` and the docs' settings tables are made."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import math
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["INT_LIMIT", "Flag", "add_flags", "check", "check_bool", "check_int", "check_number", "check_optional_int",
           "check_optional_str", "check_str", "field_default", "field_docs", "field_names", "flag", "flag_fields",
           "flag_name", "flag_values", "load_json_config", "read_json_object", "shown"]

INT_LIMIT = 2**63
"""Integers odb reads from a config stay below this: ranks exchange them (and sums of them) as int64."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raises a ValueError naming ``name`` unless ``value`` is an int (not a bool) in [minimum, 2**63)."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value >= INT_LIMIT:
        raise ValueError(f"{name} must be < 2**63 (odb exchanges it as int64), got {value}")


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """Raises a ValueError naming ``name`` unless ``value`` is a finite int or float (not a bool)
    within [low, high] (``high`` None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if high is not None and not low <= value <= high:
        raise ValueError(f"{name} must be within [{low}, {high}], got {value}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_str(name: str, value: Any) -> None:
    """Raises a ValueError naming ``name`` unless ``value`` is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def check(condition: bool, message: str) -> None:
    """Raises a ValueError with ``message`` unless ``condition``."""
    if not condition:
        raise ValueError(message)


def check_optional_int(name: str, value: Any, minimum: int) -> None:
    if value is not None:
        check_int(name, value, minimum)


def check_optional_str(name: str, value: Any) -> None:
    if value is not None:
        check_str(name, value)


def read_json_object(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON object from ``path``; a missing file or bad JSON is an error naming ``fix``."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"{what} {path} is a folder, not a JSON file; {fix}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}")
    try:
        values = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # bad JSON, not UTF-8, a 5000-digit number, nesting too deep
        raise ValueError(f"{what} {path} is not valid JSON: {err}; {fix}") from err
    if not isinstance(values, dict):
        raise ValueError(f"{what} {path} must hold a JSON object {{\"key\": value, ...}}, got "
                         f"{json.dumps(values)[:60]}; {fix}")
    return values


def load_json_config(path: str | Path, *, known: Iterable[str], what: str, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``, every key one of ``known``: the one strict loader of every odb
    JSON config (odb, data, LoRA).

    Raises:
        FileNotFoundError: no such file (the message says ``fix``).
        ValueError: not a JSON object, or a key not in ``known`` (the message names the file, the
            key and the known keys).
    """
    values = read_json_object(path, what, fix)
    known = list(known)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{what} {path}: unknown key(s) {unknown}; known keys are {known}")
    return values


def field_names(cls) -> list[str]:
    """The names a dataclass takes in its constructor."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (its source's string right after
    the annotated name), whitespace folded; a field without one is absent."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# ---- flags made from the settings dataclasses --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Flag:
    """How a settings field appears on the command line (its ``metadata["flag"]``, :func:`flag`);
    everything else (type, default, help) is the field's own."""

    name: str | None = None
    """The flag (default ``--<field name>``)."""
    choices: tuple[Any, ...] | None = None
    action: str | None = None
    """'store_false' for a field that is True by default (name the flag ``--no_...``)."""
    nargs: str | None = None
    const: Any = None
    parse: Callable[[Any], Any] | None = None
    """The command line's value -> the field's (e.g. a comma-separated list -> a tuple)."""
    shown_default: str | None = None
    """What ``--help`` says the default is, where the field's own value is not what a user sees."""


def flag(name: str | None = None, **options: Any) -> dict[str, Flag]:
    """A dataclass field's ``metadata`` for :func:`add_flags`: ``field(default=..., metadata=flag(...))``."""
    return {"flag": Flag(name, **options)}


def _spec(field: dataclasses.Field) -> Flag:
    return field.metadata.get("flag") or Flag()


def flag_name(field: dataclasses.Field) -> str:
    return _spec(field).name or f"--{field.name}"


def _dest(field: dataclasses.Field) -> str:
    return flag_name(field).lstrip("-")


def field_default(field: dataclasses.Field) -> Any:
    """The field's default (None where it has none: the caller supplies it)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _scalar(hint: Any) -> type | None:
    """int, float, str or bool for ``X`` or ``X | None``; tuple[str, ...] -> str; else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint in (int, float, str, bool):
        return hint
    if len(args) == 1 and args[0] in (int, float, str, bool) and typing.get_origin(hint) in (typing.Union,
                                                                                              types.UnionType):
        return args[0]
    if typing.get_origin(hint) is tuple and args and args[0] is str:
        return str
    return None


def shown(value: Any) -> str:
    """A default as ``--help`` and the docs show it."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "''"
    return "None" if value is None else str(value)


def flag_fields(cls: type, *, only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that are flags: ``only`` these, or all but ``skip``."""
    only, skip = (None if only is None else set(only)), set(skip)
    return [f for f in dataclasses.fields(cls)
            if f.init and f.name not in skip and (only is None or f.name in only)]


def add_flags(parser: Any, cls: type, *, only: Iterable[str] | None = None, skip: Iterable[str] = (),
              defaults: dict[str, Any] | None = None, override: bool = False) -> None:
    """Adds to ``parser`` (or an argument group) one flag per field of dataclass ``cls``: its name
    (``--<field>`` unless :func:`flag` names another), type, choices and default, and its
    docstring as the help.

    Args:
        only / skip: which fields (default: every init field).
        defaults: defaults of fields the dataclass leaves to the caller (files a launcher names).
        override: the flags override a config file's values: each defaults to None ("the file's").
    """
    hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), defaults or {}
    for f in flag_fields(cls, only=only, skip=skip):
        spec, kind = _spec(f), _scalar(hints[f.name])
        default = defaults.get(f.name, field_default(f))
        help_text = docs.get(f.name, "")
        if override:
            fallback = f"the file's value, else {shown(default)}"
            help_text += f" (default: {spec.shown_default or fallback})"
        elif spec.shown_default or default is not None and kind is not bool:
            help_text += f" (default: {spec.shown_default or shown(default)})"
        options: dict[str, Any] = {"dest": _dest(f), "help": help_text.replace("%", "%%")}
        if kind is bool:
            if override:
                options.update(action=argparse.BooleanOptionalAction, default=None)
            else:
                options.update(action=spec.action or "store_true", default=default)
        else:
            if kind is None and spec.parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: no flag for a {hints[f.name]} without Flag.parse")
            options.update(type=kind or str, default=None if override else default)
            if spec.choices is not None:
                options["choices"] = spec.choices
            if spec.nargs is not None:
                options.update(nargs=spec.nargs, const=spec.const)
        parser.add_argument(flag_name(f), **options)


def flag_values(cls: type, args: argparse.Namespace, *, only: Iterable[str] | None = None, skip: Iterable[str] = (),
                override: bool = False) -> dict[str, Any]:
    """The values :func:`add_flags`'s flags parsed into ``args``, by field name (with ``override``
    only those given)."""
    values = {}
    for f in flag_fields(cls, only=only, skip=skip):
        value, parse = getattr(args, _dest(f)), _spec(f).parse
        if override and value is None:
            continue
        given = value is not None and value != field_default(f)  # (a default is the field's value already)
        values[f.name] = parse(value) if parse is not None and given else value
    return values
