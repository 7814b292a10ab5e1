"""Settings plumbing every layer shares (standard library only; PyYAML imported when a YAML file is
read): value checks whose errors name the flag or key, the one strict loader of odb's config files
(JSON or YAML, or a mapping given inline by a recipe), and a dataclass's attribute docstrings (read
from its source), from which ``--help`` and the docs' settings tables are made."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["INT_LIMIT", "JSON_METAVAR", "ConfigSource", "Flag", "Inline", "add_flags", "check", "check_bool",
           "check_int", "check_number", "check_optional_int", "check_optional_str", "check_str", "field_default",
           "field_docs", "field_names", "flag", "flag_fields", "flag_name", "flag_values", "load_json_config",
           "nearest", "read_json_object", "read_yaml", "shown", "source_name"]

INT_LIMIT = 2**63
"""Integers odb reads from a config stay below this: ranks exchange them (and sums of them) as int64."""
JSON_METAVAR = "JSON"
"""The metavar of a flag whose value is a JSON object (a recipe writes a mapping as one, :mod:`odb.recipe`)."""


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


class Inline(dict):
    """A settings file's contents given inline (a recipe's ``deepspeed_config: {...}``), with where it
    was written: errors about it name :attr:`origin` as they would name a file."""

    def __init__(self, values: Mapping[str, Any], origin: str) -> None:
        super().__init__(values)
        self.origin = origin


ConfigSource = str | Path | Mapping[str, Any]
"""A settings file's path, or its contents (:class:`Inline`)."""


def read_yaml(text: str | bytes) -> Any:
    """YAML as YAML 1.2 reads it, where PyYAML's YAML 1.1 differs in what a config meets: ``1e-5`` is a
    number (1.1: a string), only true/false are booleans (1.1: also yes/no/on/off, so that
    ``preflight: off`` would be False) and a date stays a string (values stay what JSON holds)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


_YAML_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                         r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
"""YAML 1.2's floats (core schema): 1e-5, 1.5, .5, .inf, .nan."""


@cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    replaced = {f"tag:yaml.org,2002:{kind}" for kind in ("bool", "float", "timestamp")}
    Loader.yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    return Loader


def _is_yaml(path: Path) -> bool:
    return path.suffix.lower() in (".yaml", ".yml")


def read_json_object(path: ConfigSource, what: str, fix: str) -> dict[str, Any]:
    """A JSON object from ``path`` (a ``.yaml`` / ``.yml`` file: a YAML mapping; an :class:`Inline`
    mapping: a copy of it); a missing file or bad JSON is an error naming ``fix``."""
    if isinstance(path, Mapping):
        return dict(path)
    path = Path(path)
    kind = "YAML" if _is_yaml(path) else "JSON"
    if path.is_dir():
        raise FileNotFoundError(f"{what} {path} is a folder, not a {kind} file; {fix}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}")
    if _is_yaml(path):
        import yaml

        try:
            values = read_yaml(path.read_bytes())
        except (yaml.YAMLError, RecursionError) as err:
            raise ValueError(f"{what} {path} is not valid YAML: {err}; {fix}") from err
    else:
        try:
            values = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as err:  # bad JSON, not UTF-8, a 5000-digit number, nesting too deep
            raise ValueError(f"{what} {path} is not valid JSON: {err}; {fix}") from err
    if not isinstance(values, dict):
        shape = "a YAML mapping (key: value lines)" if kind == "YAML" else 'a JSON object {"key": value, ...}'
        raise ValueError(f"{what} {path} must hold {shape}, got {json.dumps(values, default=str)[:60]}; {fix}")
    return values


def source_name(path: ConfigSource) -> str:
    """How messages name a settings source: its path, or where an inline one was written."""
    return getattr(path, "origin", "(inline)") if isinstance(path, Mapping) else str(path)


def nearest(key: str, known: Iterable[str]) -> str | None:
    """The known key most like ``key`` (a typo's fix), None when none is close."""
    found = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def load_json_config(path: ConfigSource, *, known: Iterable[str], what: str, fix: str) -> dict[str, Any]:
    """The JSON (or YAML) object in ``path``, or an :class:`Inline` mapping, every key one of
    ``known``: the one strict loader of every odb config (odb, data, LoRA, FSDP2).

    Raises:
        FileNotFoundError: no such file (the message says ``fix``).
        ValueError: not an object, or a key not in ``known`` (the message names the file, the
            key, the known keys and the nearest of them).
    """
    values = read_json_object(path, what, fix)
    known = list(known)
    unknown = sorted(set(values) - set(known), key=str)
    if unknown:
        hints = [f"{near!r} for {key!r}" for key in unknown if (near := nearest(str(key), known)) is not None]
        hint = f"; did you mean {', '.join(hints)}?" if hints else ""
        raise ValueError(f"{what} {source_name(path)}: unknown key(s) {unknown}; known keys are {known}{hint}")
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
    metavar: str | None = None
    """How ``--help`` names the value (:data:`JSON_METAVAR`: a JSON object, which a recipe may give as a mapping)."""
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
            if spec.metavar is not None:
                options["metavar"] = spec.metavar
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
