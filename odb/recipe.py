"""A run in one YAML file, a recipe: ``odb train RECIPE.yaml [key=value ...]``.

A recipe's keys are ``launch/train.py``'s flags without their dashes, so a recipe, the overrides
after it on ``odb train``'s command line and the flags are one vocabulary (``docs/settings.md``
lists it), and a recipe is read by the same parser as the flags
(:func:`odb.training.launch.flags.parse_config`): :meth:`Recipe.arguments` turns its values into that
parser's arguments, which go before the command line's (a flag given there wins). A recipe and
the equivalent flags therefore give the same :class:`~odb.training.config.settings.RunConfig`::

    model: /models/Qwen2.5-7B-Instruct
    data: /data/sft.jsonl
    deepspeed_config: ds_zero3.json        # a settings file: relative to this recipe's folder ...
    odb_config: {max_tokens: auto, gas: 1} # ... or its keys inline
    gradient_checkpointing: true           # a switch: true gives the flag, false leaves it out
    lr: 2.0e-5
    nproc: 8                               # odb train's own: the ranks it starts on this machine

How a value becomes arguments: ``null`` leaves the flag at its default; a switch (``save_hf``) is
given when true; a switch with a ``--no-`` form (``strict``) is given either way; a flag whose value
is optional (``lora``, ``resume``) is given bare when true; a list is joined with commas
(``wandb_tags``); a mapping, for a flag that takes a JSON object (``chat_template_kwargs``), is
written as that JSON; anything else is the flag's value as text. The settings files (``odb_config``,
``data_config``, ``deepspeed_config``, ``fsdp_config``, ``lora``) take a path, relative to the
recipe's folder (where a recipe keeps its companions), or a mapping with the keys the file would
hold, handed to the loaders as an :class:`~odb.settings.Inline` that names where it was written.
Other paths (``model``, ``data``, ``output_dir``) are the command line's: relative to the working
folder. An override's value is the command line's text (``save_hf=false``, ``lr=1e-5``; ``{...}``:
a YAML mapping, for a settings file inline), and its paths are the working folder's too.

Everything is checked before any rank starts: a key that is no flag names the file, the key and
the nearest valid key.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odb.settings import JSON_METAVAR, Inline, nearest, read_json_object, read_yaml

__all__ = ["LAUNCH_KEYS", "SUFFIXES", "Recipe", "bundled_root", "find_recipe", "load_recipe", "parse_overrides",
           "recipe_names"]

LAUNCH_KEYS = ("nproc",)
"""Keys of ``odb train`` itself, not flags of a rank: ``nproc``, the ranks it starts on this machine
(a rank under a launcher or SLURM ignores it)."""
SUFFIXES = (".yaml", ".yml", ".json")
"""What a recipe file is named (a JSON object reads as well)."""
_NOT_KEYS = ("help", "local_rank", "recipe")
"""The parser's flags that are no recipe key."""


def bundled_root() -> Path:
    """The folder holding the files odb bundles (``configs/``, ``data/``, ``launch/``): the package's
    copy (``odb/_bundled``, which setup.py's build writes into a wheel) when installed, else the
    checkout the package sits in (a clone, an editable install)."""
    package = Path(__file__).resolve().parent
    copy = package / "_bundled"
    return copy if copy.is_dir() else package.parent


@dataclass(frozen=True)
class Recipe:
    """A recipe file's values and the command line's overrides of them (kept apart: their paths
    are relative to different folders)."""

    path: Path
    values: Mapping[str, Any]
    """The file's keys and values, as YAML read them."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """``key=value`` from the command line: the text after ``=`` (a mapping for ``{...}``)."""

    def get(self, key: str, default: Any = None) -> Any:
        """A key's value, the override's if there is one."""
        return self.overrides.get(key, self.values.get(key, default))

    def arguments(self, parser: argparse.ArgumentParser, *, settings_files: Iterable[str]
                  ) -> tuple[list[str], dict[str, Inline]]:
        """The recipe as ``parser``'s arguments: the command-line words, and the settings files given
        inline, by flag (for ``parser.set_defaults``: a flag on the command line still wins).

        Raises:
            ValueError: a key that is no flag of ``parser`` (naming the recipe, the key and the
                nearest key), or a value the flag cannot take.
        """
        actions = _recipe_actions(parser)
        settings_files = set(settings_files)
        words: list[str] = []
        inline: dict[str, Inline] = {}
        for origin, values in ((f"recipe {self.path}", self.values), ("the command line", self.overrides)):
            for key in values:
                if key not in actions and key not in LAUNCH_KEYS:
                    near = nearest(str(key), [*actions, *LAUNCH_KEYS])
                    hint = f"; did you mean {near!r}?" if near else ""
                    raise ValueError(f"{origin}: unknown key {key!r}{hint} (a recipe's keys are launch/train.py's "
                                     "flags without their dashes: docs/settings.md lists them)")
        merged = {**self.values, **self.overrides}
        for key, value in merged.items():
            if key in LAUNCH_KEYS:
                continue
            where = f"the command line's {key}" if key in self.overrides else f"recipe {self.path}: {key}"
            if key in settings_files and isinstance(value, Mapping):
                inline[key] = Inline(value, origin=f"({where})")
                continue
            if key in settings_files and isinstance(value, str) and value.lower() not in ("", "true", "false") \
                    and key not in self.overrides:
                value = str((self.path.parent / Path(value).expanduser()).resolve())
            words += _words(actions[key], value, where)
        return words, inline


def _recipe_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by recipe key (the flag without its dashes: its ``dest``)."""
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest not in _NOT_KEYS}


def _words(action: argparse.Action, value: Any, where: str) -> list[str]:
    """The command-line words of ``action`` that say ``value``."""
    flag = action.option_strings[0]
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag] if _switch(value, where) else [f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true / store_false: the flag says the value that is not the default
        return [flag] if _switch(value, where) else []
    if action.nargs == "?" and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
        return [flag] if _switch(value, where) else []
    if isinstance(value, Mapping) and action.metavar == JSON_METAVAR:  # (e.g. chat_template_kwargs)
        return [f"{flag}={json.dumps(dict(value))}"]
    if isinstance(value, Mapping):
        raise ValueError(f"{where} takes a value, not a mapping (only the settings files and chat_template_kwargs "
                         "take a mapping)")
    if isinstance(value, bool):
        raise ValueError(f"{where} takes a value, not {str(value).lower()}")
    if isinstance(value, (list, tuple)) and action.nargs == "+":  # (e.g. data: a list of sources)
        return [flag, *(json.dumps(dict(v)) if isinstance(v, Mapping) else str(v) for v in value)]
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return [f"{flag}={value}"]


def _switch(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{where} must be true or false, got {value!r}")


def parse_overrides(words: Sequence[str]) -> dict[str, Any]:
    """``key=value`` words -> {key: value}: the value is the text after the first ``=``; ``null``
    drops the recipe's value (the flag's default), and a ``{...}`` value is read as a YAML mapping (a
    settings file inline). The last of a repeated key wins."""
    overrides: dict[str, Any] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ValueError(f"{word!r} is not a key=value override (e.g. max_samples=100 output_dir=runs/x)")
        if value == "null":
            value = None
        elif value.lstrip().startswith("{"):
            value = read_yaml(value)
            if not isinstance(value, dict):
                raise ValueError(f"the command line's {key}: {{...}} must be a YAML mapping such as "
                                 "{zero_optimization: {stage: 3}}")
        overrides[key] = value
    return overrides


def recipe_names(folder: Path | None) -> list[str]:
    """The recipes in ``folder`` (the bundled ones: ``odb train NAME``), by name."""
    if folder is None or not folder.is_dir():
        return []
    return sorted({p.stem for p in folder.iterdir() if p.suffix in SUFFIXES[:2]})


def find_recipe(name: str | Path, folder: Path | None = None) -> Path:
    """The recipe file ``name`` names: a path, or the name of one in ``folder`` (``demo``:
    ``folder/demo.yaml``)."""
    path = Path(name)
    if path.is_file():
        return path
    if folder is not None and path.name == str(name):  # a name, no folder: a bundled recipe's
        for suffix in SUFFIXES[:2]:
            if (folder / f"{name}{suffix}").is_file():
                return folder / f"{name}{suffix}"
    names = recipe_names(folder)
    bundled = f"; the bundled recipes are {', '.join(names)} (odb recipes lists them)" if names else ""
    near = nearest(str(name), names)
    hint = f"; did you mean {near!r}?" if near else ""
    raise FileNotFoundError(f"recipe {name} does not exist: pass a recipe file (.yaml){bundled}{hint}")


def load_recipe(name: str | Path, *, folder: Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe ``name`` (:func:`find_recipe`) with the command line's ``key=value`` overrides."""
    path = find_recipe(name, folder)
    values = read_json_object(path, "recipe", "write one key: value per line, the keys launch/train.py's flags "
                                              "without their dashes (see configs/recipes/)")
    return Recipe(path=path.resolve(), values=values, overrides=parse_overrides(overrides))
