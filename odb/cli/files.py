"""``odb recipes`` and ``odb path``: the files odb bundles (recipes, configs, the demo's model,
tokenizer and data, ``launch/slurm.sbatch``), found in the checkout or in the installed package
(:func:`odb.recipe.bundled_root`)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

__all__ = ["path", "recipes"]


def recipes(argv: list[str] | None = None, prog: str = "odb recipes") -> int:
    """Lists the bundled recipes, or prints one, ready to copy and edit: ``odb recipes demo > my.yaml``."""
    from odb.recipe import find_recipe, recipe_names
    from odb.training.launch.flags import SETTINGS_FILES, FileDefaults

    p = argparse.ArgumentParser(prog=prog, description=recipes.__doc__)
    p.add_argument("name", nargs="?", help="print this recipe (its settings files' paths made absolute)")
    args = p.parse_args(argv)
    folder = FileDefaults.bundled().recipes
    if args.name is None:
        for name in recipe_names(folder):
            print(f"{name:28} {_summary(find_recipe(name, folder))}")
        return 0
    try:
        recipe = find_recipe(args.name, folder)
    except FileNotFoundError as err:
        sys.exit(f"{prog}: {err}")
    print(f"# {recipe.resolve()}")
    print(_absolute(recipe, SETTINGS_FILES), end="")
    return 0


def _summary(recipe: Path) -> str:
    """A recipe's first comment line."""
    for line in recipe.read_text().splitlines():
        if line.startswith("#") and line.strip("# "):
            return line.strip("# ")
    return ""


def _absolute(recipe: Path, keys: tuple[str, ...]) -> str:
    """The recipe's text, each top-level ``key: relative/path`` of a settings file made absolute (a
    copy elsewhere still finds them)."""
    line = re.compile(rf"^({'|'.join(keys)}):(\s+)([^\s{{#'\"][^\s#]*)(.*)$")

    def absolute(match: re.Match) -> str:
        value = match[3]
        if value.lower() in ("true", "false", "null", "~") or Path(value).is_absolute():
            return match[0]
        return f"{match[1]}:{match[2]}{(recipe.parent / value).resolve()}{match[4]}"

    return "".join(line.sub(absolute, text) for text in recipe.read_text().splitlines(keepends=True))


def path(argv: list[str] | None = None, prog: str = "odb path") -> int:
    """Prints where a bundled file is (``odb path launch/slurm.sbatch``), or the folder that holds
    them (configs/, data/, launch/)."""
    from odb.recipe import bundled_root

    p = argparse.ArgumentParser(prog=prog, description=path.__doc__)
    p.add_argument("name", nargs="?", help="a bundled file, by its path in that folder or its name (slurm.sbatch)")
    args = p.parse_args(argv)
    root = bundled_root()
    if args.name is None:
        print(root)
        return 0
    found = [root / args.name] if (root / args.name).exists() else \
        sorted(p for top in ("configs", "launch", "data") for p in (root / top).rglob(args.name))
    if len(found) != 1:
        what = "is not" if not found else f"names {len(found)} files ({', '.join(map(str, found))}) but not one"
        sys.exit(f"{prog}: {args.name} {what} among the bundled files in {root}: name a path such as "
                 "launch/slurm.sbatch or configs/ds_zero3.json")
    print(found[0])
    return 0
