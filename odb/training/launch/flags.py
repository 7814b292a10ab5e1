"""The flags of ``launch/train.py`` (or a recipe, :mod:`odb.recipe`: the same flags in a YAML file) ->
a :class:`~odb.training.config.settings.RunConfig`, checked before any process group is joined.

Everything that can be wrong with the inputs (a missing file, a model folder that does not
exist, a DeepSpeed config that contradicts odb, an unknown key in a JSON config) fails here,
identically on every rank, with a message that names the fix; nothing reaches a collective that
could hang. The default files are the caller's (:class:`FileDefaults`): ``launch/train.py`` names
them relative to the repository it sits in, an installed ``odb`` finds them in its package
(:func:`bundled_root`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from odb.batching.config import OdbConfig, load_odb_config
from odb.data.config import DataConfig, load_data_config
from odb.data.mixture import SourceSpec, is_plain_path, parse_sources, source_words
from odb.recipe import Recipe, bundled_root, load_recipe
from odb.settings import add_flags, field_docs, flag_values, load_json_config, read_json_object
from odb.training.config.lora import lora_keys
from odb.training.config.objective import ObjectiveSettings
from odb.training.config.optimization import BACKEND_FILES, BACKENDS, OptimizationSettings, default_lr
from odb.training.config.settings import (
    CheckpointSettings,
    DataSettings,
    LoggingSettings,
    ModelSettings,
    PreflightSettings,
    RunConfig,
    RunSettings,
)
from odb.training.launch.output_dir import DERIVED, RUN_RECORDS, resume_tag

__all__ = ["FileDefaults", "SETTINGS_FILES", "check_inputs", "parse_config", "parser"]


@dataclass(frozen=True, kw_only=True)
class FileDefaults:
    """The files a run uses when no flag names one."""

    deepspeed_config: Path
    odb_config: Path
    """odb's settings for the bundled tiny models (the CPU demo's)."""
    model: Path
    data: Path
    tokenizer: Path
    """Used when the model folder has no tokenizer of its own."""
    vl_model: Path | None = None
    """The bundled tiny vision-language model config, whose tokenizer is :attr:`vl_tokenizer`."""
    vl_tokenizer: Path | None = None
    """:attr:`vl_model`'s tokenizer: :attr:`tokenizer` plus ``<|video_pad|>``, its video token."""
    lora: Path
    """What a bare ``--lora`` reads."""
    fsdp_config: Path | None = None
    """FSDP2's settings under ``--backend fsdp2`` (None: the built-in defaults)."""
    own_odb_config: Path | None = None
    """odb's settings for a model of the user's own (None: :attr:`odb_config`)."""
    recipes: Path | None = None
    """The folder of the recipes named by name (``odb train demo``, ``--recipe demo``)."""

    @classmethod
    def bundled(cls, root: Path | None = None) -> FileDefaults:
        """The files odb bundles, under ``root`` (a checkout's root, ``launch/train.py``'s; default:
        :func:`bundled_root`)."""
        root = bundled_root() if root is None else root
        configs = root / "configs"
        return cls(deepspeed_config=configs / "ds_zero2.json", odb_config=configs / "odb.json",
                   model=configs / "tiny_model.json", data=root / "data" / "chat.jsonl",
                   tokenizer=root / "data" / "tokenizer", vl_model=configs / "tiny_vl_model.json",
                   vl_tokenizer=root / "data" / "vl_tokenizer", lora=configs / "lora.json",
                   fsdp_config=configs / "fsdp2.json", own_odb_config=configs / "recipes" / "odb.json",
                   recipes=configs / "recipes")

    def is_demo_model(self, model: str | Path) -> bool:
        """Whether ``model`` is one of the bundled tiny model configs (in :attr:`model`'s folder)."""
        path = Path(model).resolve()
        return path.is_file() and path.parent == Path(self.model).resolve().parent

    def tokenizer_for(self, model: str | Path) -> Path:
        """The tokenizer of a model without one of its own (a config JSON, or a folder with none):
        :attr:`vl_tokenizer` for :attr:`vl_model`, else :attr:`tokenizer`."""
        if self.vl_model is not None and self.vl_tokenizer is not None and \
                Path(model).resolve() == Path(self.vl_model).resolve():
            return self.vl_tokenizer
        return self.tokenizer


def parser(defaults: FileDefaults) -> argparse.ArgumentParser:
    """The run's flags, made from the settings dataclasses (:func:`odb.settings.add_flags`: each
    field's name, type, default and docstring), besides the files they are read from."""
    # no abbreviations: launch/slurm.sbatch reads --output_dir, --resume and --overwrite_output_dir by their names
    p = argparse.ArgumentParser(description="Fine-tune a causal LM with odb's online dynamic batching "
                                            "under DeepSpeed (deepspeed --num_gpus N launch/train.py ...) or FSDP2 "
                                            "(torchrun --nproc_per_node N launch/train.py --backend fsdp2 ...)",
                                allow_abbrev=False)
    files = p.add_argument_group("settings files")
    files.add_argument("--recipe", default=None,
                       help="a recipe: these flags, without their dashes, as the keys of a YAML file (odb train's; "
                            "docs/recipes.md), or the name of a bundled one; the flags given here win over it")
    own = defaults.own_odb_config or defaults.odb_config
    files.add_argument("--odb_config", default=None,
                       help=f"odb's batching settings JSON (or YAML): the batching keys (default: "
                            f"{defaults.odb_config} for the bundled tiny models, the CPU demo's; {own} for a model "
                            "of your own)")
    files.add_argument("--data_config", default=None,
                       help="data settings JSON (or YAML): the data keys (format, labels, the system message, chat "
                            "template variables, truncation, augmentation, image sizes, strict) (default: none, the "
                            "built-in values)")
    for file in BACKEND_FILES.values():
        default = getattr(defaults, file.flag[2:])
        files.add_argument(file.flag, default=None,
                           help=f"{file.help} (default: {default or 'none, the built-in values'})")
    files.add_argument("--lora", nargs="?", const=str(defaults.lora), default=None,
                       help=f"{field_docs(ModelSettings)['lora']} The flag alone reads {defaults.lora}.")
    add_flags(p.add_argument_group("model"), ModelSettings, skip=("lora",), defaults={"path": str(defaults.model)})
    data = p.add_argument_group("data")
    add_flags(data, DataSettings, skip=("processing", "sources", "eval_sources"), defaults={"path": str(defaults.data)})
    add_flags(data, DataConfig, only=_DATA_OVERRIDES, override=True)
    add_flags(p.add_argument_group("batching: odb's keys, over --odb_config's"), OdbConfig, skip=_TRAINER_SETS,
              override=True)
    add_flags(p.add_argument_group("optimization"), OptimizationSettings, skip=BACKENDS,
              defaults={"lr": None})  # (None: default_lr, once the model is known)
    add_flags(p.add_argument_group("objective"), ObjectiveSettings)
    add_flags(p.add_argument_group("run"), RunSettings)
    add_flags(p.add_argument_group("preflight: the worst-case step before the first sample"), PreflightSettings)
    checkpoints = p.add_argument_group("checkpoints and export")
    add_flags(checkpoints, CheckpointSettings)
    checkpoints.add_argument("--overwrite_output_dir", action="store_true",
                             help="start over in an --output_dir that holds an earlier run: its "
                                  f"{', '.join(RUN_RECORDS + DERIVED)} are removed first (nothing else there)")
    add_flags(p.add_argument_group("logging"), LoggingSettings)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by launchers
    return p


SETTINGS_FILES = ("odb_config", "data_config", *(file.flag[2:] for file in BACKEND_FILES.values()), "lora")
"""The flags that name a settings file; a recipe may give the file's keys inline instead."""


_DATA_OVERRIDES = ("format", "strict", "system_message", "chat_template_kwargs")
"""The data settings that are also flags, over --data_config's."""


_TRAINER_SETS = ("pad_rows",)
"""odb settings the trainer sets itself (a model it cannot pack): no flag."""


def _need_file(path: str | Path, what: str, fix: str) -> Path:
    if not str(path):  # (Path("") is the current folder)
        raise FileNotFoundError(f"{what}: the path is empty; {fix}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {p} does not exist; {fix}")
    return p


_MODEL_FIX = ("pass a local HF model folder (with config.json) to --model, or a model config JSON such as "
              "configs/tiny_model.json")


def _model(args: argparse.Namespace, defaults: FileDefaults) -> ModelSettings:
    """The model's settings, its paths checked (a model config's type later: :func:`_check_model_config`)."""
    model = _need_file(args.model, "model", _MODEL_FIX)
    if model.is_dir() and not (model / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model} has no config.json; {_MODEL_FIX}")
    tokenizer = args.tokenizer
    if tokenizer is None:
        has_own = model.is_dir() and (model / "tokenizer_config.json").is_file()
        tokenizer = str(model) if has_own else str(defaults.tokenizer_for(model))
    tokenizer_fix = "pass --tokenizer with a folder from save_pretrained"
    if not _need_file(tokenizer, "tokenizer folder", tokenizer_fix).is_dir():
        raise FileNotFoundError(f"tokenizer folder {tokenizer} is not a folder; {tokenizer_fix}")
    lora = None
    if isinstance(args.lora, Mapping) or args.lora:
        lora = load_json_config(args.lora, known=lora_keys(), what="LoRA config", fix="pass --lora configs/lora.json")
    return ModelSettings(**{**flag_values(ModelSettings, args, skip=("lora",)), "path": str(model),
                            "tokenizer": tokenizer, "lora": lora})


def _check_model_config(path: Path, fix: str) -> None:
    """A model config JSON (random init) names a model type transformers knows."""
    from transformers import CONFIG_MAPPING

    model_type = read_json_object(path, "model config", fix).get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"model config {path}: \"model_type\" must name a transformers model type such as "
                         f"\"llama\" or \"qwen2\", got {model_type!r}; {fix}")


def _world_size() -> int:
    """The launcher's WORLD_SIZE (deepspeed, torchrun set it before we start); 1 without one."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        world_size = int(value)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ValueError(f"the environment's WORLD_SIZE must be an integer >= 1, got {value!r}; start with "
                         "deepspeed or torchrun, which set it, or unset it for one process")
    return world_size


def _batching(args: argparse.Namespace, defaults: FileDefaults) -> OdbConfig:
    if args.odb_config is None:
        demo = defaults.is_demo_model(args.model)
        args.odb_config = str(defaults.odb_config if demo else defaults.own_odb_config or defaults.odb_config)
    source = args.odb_config  # (a mapping: given inline by a recipe)
    if not isinstance(source, Mapping):
        source = _need_file(source, "odb config", "pass --odb_config configs/odb.json")
    return load_odb_config(source, **flag_values(OdbConfig, args, skip=_TRAINER_SETS, override=True))


def _data(args: argparse.Namespace) -> DataSettings:
    path, sources = _sources(args.data, "--data", "pass --data data/chat.jsonl, or your own file or folder")
    eval_path, eval_sources = None, ()
    if args.eval_data is not None:
        eval_path, eval_sources = _sources(args.eval_data, "--eval_data",
                                           "pass a validation file or folder, or --val_ratio R instead")
        if any(s.weight is not None for s in eval_sources):
            raise ValueError("--eval_data sources take no weight (each is scored whole): pass NAME=PATH")
    processing = load_data_config(args.data_config, **flag_values(DataConfig, args, only=_DATA_OVERRIDES,
                                                                  override=True))
    values = flag_values(DataSettings, args, skip=("processing", "path", "eval_path", "sources", "eval_sources"))
    return DataSettings(processing=processing, path=path, sources=sources, eval_path=eval_path,
                        eval_sources=eval_sources, **values)


def _sources(values: str | list[str], flag: str, fix: str) -> tuple[str, tuple[SourceSpec, ...]]:
    """``--data``'s (or ``--eval_data``'s) words: one path, or named sources (:func:`parse_sources`),
    each of whose paths must exist. Returns the path (for a mixture, its words) and the sources."""
    words = source_words(values)
    if is_plain_path(words):
        _need_file(words[0], f"{flag} path", fix)
        return str(words[0]), ()
    sources = parse_sources(words)
    for source in sources:
        _need_file(source.path, f"{flag} source {source.name!r}: path", fix)
    return " ".join(f"{s.name}={s.path}" + (f":{s.weight:g}" if s.weight is not None else "") for s in sources), sources


def parse_config(argv: list[str] | None = None, *, defaults: FileDefaults, recipe: Recipe | None = None
                 ) -> RunConfig:
    """The run's config from ``argv`` (default: ``sys.argv[1:]``) over ``recipe``'s (else the one
    ``--recipe`` names); raises naming the fix. What needs no torch is checked first
    (:func:`check_inputs`): a typo fails in a second, not after a minute of imports."""
    args, backend_file, config = _checked(argv, defaults=defaults, recipe=recipe)
    import torch

    from odb.training import backends

    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    backend = backends.get(args.backend)
    settings = backend.load_settings(backend_file, gas=config.batching.gas, world_size=_world_size(),
                                     use_bf16=use_bf16)
    # last, once every input is known good: --overwrite_output_dir removes the earlier run here
    optimization = dataclasses.replace(config.optimization, **{backend.NAME: settings})
    return dataclasses.replace(config, optimization=optimization,
                               checkpoints=dataclasses.replace(config.checkpoints, resume=resume_tag(args)))


def check_inputs(argv: list[str] | None = None, *, defaults: FileDefaults, recipe: Recipe | None = None) -> None:
    """Every check of :func:`parse_config` that needs no torch (values, paths, a model config's
    type): what ``odb train`` runs before it starts the launcher. The output folder and the backend
    file's contents are the ranks' to check (they may remove an earlier run). Raises naming the fix."""
    _checked(argv, defaults=defaults, recipe=recipe)


def _checked(argv: list[str] | None, *, defaults: FileDefaults, recipe: Recipe | None
             ) -> tuple[argparse.Namespace, Any, RunConfig]:
    """The parsed flags, the backend's settings file (or a recipe's inline mapping; None: the
    built-in values) and the run's config with the backend's settings not read yet (their type's
    stand-in, :attr:`~odb.training.config.optimization.BackendFile.unread`) and no resume tag."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(defaults)
    if recipe is None:
        named = _named_recipe(argv)
        recipe = None if named is None else load_recipe(named, folder=defaults.recipes)
    if recipe is not None:  # its words first: the command line's flags win
        words, inline = recipe.arguments(p, settings_files=SETTINGS_FILES)
        p.set_defaults(**inline)
        argv = [*words, *argv]
    args = p.parse_args(argv)
    run = RunSettings(**flag_values(RunSettings, args))
    batching = _batching(args, defaults)
    _world_size()  # (checked here, read again by parse_config)
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {args.backend!r}")
    file = BACKEND_FILES[args.backend]
    for name, other in BACKEND_FILES.items():
        if name != args.backend and getattr(args, other.flag[2:]) is not None:
            raise ValueError(f"{other.flag} configures --backend {name}; pass --backend {name}, or drop "
                             f"{other.flag} and configure --backend {args.backend} with {file.flag}")
    source = getattr(args, file.flag[2:])  # (FileDefaults names each backend's default file after its flag)
    source = source if isinstance(source, Mapping) else source or getattr(defaults, file.flag[2:])
    if source is not None and not isinstance(source, Mapping):
        _need_file(source, file.what, f"pass {file.flag} {file.example}, or a file of your own")
    data = _data(args)
    model = _model(args, defaults)
    if args.save_adapter_only and model.lora is None:
        raise ValueError("--save_adapter_only saves a LoRA adapter: train with --lora, or drop the flag")
    optimization = flag_values(OptimizationSettings, args, skip=BACKENDS)
    if optimization["lr"] is None:
        optimization["lr"] = default_lr(lora=model.lora is not None, bundled_model=defaults.is_demo_model(model.path))
    placeholder = {} if file.unread is None else {args.backend: file.unread}
    config = RunConfig(
        model=model, data=data, batching=batching, run=run,
        optimization=OptimizationSettings(**optimization, **placeholder),
        checkpoints=CheckpointSettings(**flag_values(CheckpointSettings, args)),
        logging=LoggingSettings(**flag_values(LoggingSettings, args)),
        preflight=PreflightSettings(**flag_values(PreflightSettings, args)),
        objective=ObjectiveSettings(**flag_values(ObjectiveSettings, args)))
    if Path(model.path).is_file():  # a model config JSON (random init): transformers must know its type
        _check_model_config(Path(model.path), _MODEL_FIX)
    return args, source, config


def _named_recipe(argv: list[str]) -> str | None:
    """The recipe ``--recipe`` names in ``argv`` (the last one), None if none."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recipe", default=None)
    return pre.parse_known_args(argv)[0].recipe
