"""The settings tables of ``docs/settings.md`` (between its marker lines), made from the settings
dataclasses and the run's flags, which are made from them too: ``python tools/make/settings_tables.py``
writes them, and ``tests/unit/test_settings_docs.py`` fails when the page and the code differ."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from odb.batching.config import OdbConfig
from odb.data.processing import DataConfig
from odb.settings import field_default, field_docs, field_names, shown
from odb.training.config.optimization import Fsdp2Settings
from odb.training.launch.flags import FileDefaults, parser

__all__ = ["BEGIN", "END", "settings_tables"]

BEGIN = "<!-- BEGIN GENERATED SETTINGS -->"


END = "<!-- END GENERATED SETTINGS -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    shown_default = re.search(r"\(default:? ([^)]*)\)$", action.help or "")
    if shown_default:
        return shown_default.group(1)
    if action.const is not None and action.nargs == "?":
        return f"off (`{action.const}` when given bare)"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "off"
    return "none" if action.default is None else f"`{shown(action.default)}`"


def _flag_tables(root: Path) -> list[str]:
    lines = []
    for group in parser(FileDefaults.bundled(root))._action_groups:
        actions = [a for a in group._group_actions if a.help not in (None, argparse.SUPPRESS) and a.option_strings
                   and a.dest != "help"]
        if not actions:
            continue
        lines += [f"### Flags: {group.title}", "", "| flag | default | what |", "|---|---|---|"]
        for action in actions:
            what = re.sub(r" \(default:? [^)]*\)$", "", action.help.replace("%%", "%"))
            lines.append(f"| `{action.option_strings[0]}` | {_cell(_default(action))} | {_cell(what)} |")
        lines.append("")
    return lines


def _key_table(title: str, cls: type, file: Path | None = None) -> list[str]:
    docs, given = field_docs(cls), (json.loads(file.read_text()) if file is not None else {})
    head = ["| key | default | in `" + file.name + "` | what |", "|---|---|---|---|"] if file is not None else \
        ["| key | default | what |", "|---|---|---|"]
    lines = [f"### {title}", "", *head]
    for f in [f for f in cls.__dataclass_fields__.values() if f.name in field_names(cls)]:
        cells = [f"`{f.name}`", f"`{json.dumps(field_default(f))}`"]
        if file is not None:
            cells.append(f"`{json.dumps(given[f.name])}`" if f.name in given else "")
        lines.append("| " + " | ".join([*cells, _cell(docs.get(f.name, ""))]) + " |")
    return [*lines, ""]


def settings_tables(root: Path) -> str:
    """The generated region of docs/settings.md (markers excluded), for the checkout at ``root``
    (shown with paths relative to it)."""
    lines = [*_flag_tables(Path(".")),
             *_key_table("odb's batching keys (`--odb_config`, each also a flag)", OdbConfig,
                         root / "configs" / "odb.json"),
             *_key_table("Data keys (`--data_config`)", DataConfig, root / "configs" / "data.json"),
             *_key_table("FSDP2 keys (`--fsdp_config`)", Fsdp2Settings, root / "configs" / "fsdp2.json")]
    return "\n".join(lines).rstrip("\n") + "\n"
