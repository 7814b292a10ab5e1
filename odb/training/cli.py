"""The flags of ``launch/train.py`` (or a recipe, :mod:`odb.recipe`: the same flags in a YAML file) ->
a :class:`~odb.training.config.RunConfig`, checked before any process group is joined.

Everything that can be wrong with the inputs (a missing file, a model folder that does not
exist, a DeepSpeed config that contradicts odb, an unknown key in a JSON config) fails here,
identically on every rank, with a message that names the fix; nothing reaches a collective that
could hang. The default files are the caller's (:class:`FileDefaults`): ``launch/train.py`` names
them relative to the repository it sits in, an installed ``odb`` finds them in its package
(:func:`bundled_root`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from odb.batching.config import OdbConfig, load_odb_config
from odb.data.mixture import SourceSpec, parse_source, parse_sources
from odb.data.processing import DataConfig, load_data_config
from odb.recipe import Recipe, bundled_root, load_recipe
from odb.settings import add_flags, field_docs, flag_values, load_json_config, read_json_object
from odb.training import backends
from odb.training.config import (
    CheckpointSettings,
    DataSettings,
    LoggingSettings,
    ModelSettings,
    OptimizationSettings,
    PreflightSettings,
    RunConfig,
    RunSettings,
    default_lr,
)
from odb.training.lora import lora_keys

__all__ = ["RUN_RECORDS", "SETTINGS_FILES", "FileDefaults", "bundled_root", "earlier_run", "parse_config", "parser"]


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
                   tokenizer=root / "data" / "tokenizer", lora=configs / "lora.json",
                   fsdp_config=configs / "fsdp2.json", own_odb_config=configs / "recipes" / "odb.json",
                   recipes=configs / "recipes")

    def is_demo_model(self, model: str | Path) -> bool:
        """Whether ``model`` is one of the bundled tiny model configs (in :attr:`model`'s folder)."""
        path = Path(model).resolve()
        return path.is_file() and path.parent == Path(self.model).resolve().parent


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
                       help="data settings JSON (or YAML): the data keys (format, labels, truncation, augmentation, "
                            "image sizes, strict) (default: none, the built-in values)")
    for name in backends.NAMES:
        backend = backends.get(name)
        default = getattr(defaults, backend.CONFIG_FLAG[2:])
        files.add_argument(backend.CONFIG_FLAG, default=None,
                           help=f"{backend.CONFIG_HELP} (default: {default or 'none, the built-in values'})")
    files.add_argument("--lora", nargs="?", const=str(defaults.lora), default=None,
                       help=f"{field_docs(ModelSettings)['lora']} The flag alone reads {defaults.lora}.")
    add_flags(p.add_argument_group("model"), ModelSettings, skip=("lora",), defaults={"path": str(defaults.model)})
    data = p.add_argument_group("data")
    add_flags(data, DataSettings, skip=("processing", "sources", "eval_sources"), defaults={"path": str(defaults.data)})
    add_flags(data, DataConfig, only=_DATA_OVERRIDES, override=True)
    add_flags(p.add_argument_group("batching: odb's keys, over --odb_config's"), OdbConfig, skip=_TRAINER_SETS,
              override=True)
    add_flags(p.add_argument_group("optimization"), OptimizationSettings, skip=backends.NAMES,
              defaults={"lr": None})  # (None: default_lr, once the model is known)
    add_flags(p.add_argument_group("run"), RunSettings)
    add_flags(p.add_argument_group("preflight: the worst-case step before the first sample"), PreflightSettings)
    checkpoints = p.add_argument_group("checkpoints and export")
    add_flags(checkpoints, CheckpointSettings)
    checkpoints.add_argument("--overwrite_output_dir", action="store_true",
                             help="start over in an --output_dir that holds an earlier run: its "
                                  f"{', '.join(RUN_RECORDS)} are removed first (nothing else there)")
    add_flags(p.add_argument_group("logging"), LoggingSettings)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by launchers
    return p


SETTINGS_FILES = ("odb_config", "data_config", *(backends.get(name).CONFIG_FLAG[2:] for name in backends.NAMES),
                  "lora")
"""The flags that name a settings file; a recipe may give the file's keys inline instead."""
_DATA_OVERRIDES = ("format", "strict")
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


def _model(args: argparse.Namespace, defaults: FileDefaults) -> ModelSettings:
    model_fix = ("pass a local HF model folder (with config.json) to --model, or a model config JSON such as "
                 "configs/tiny_model.json")
    model = _need_file(args.model, "model", model_fix)
    if model.is_dir() and not (model / "config.json").is_file():
        raise FileNotFoundError(f"model folder {model} has no config.json; {model_fix}")
    if model.is_file():
        _check_model_config(model, model_fix)
    tokenizer = args.tokenizer
    if tokenizer is None:
        has_own = model.is_dir() and (model / "tokenizer_config.json").is_file()
        tokenizer = str(model) if has_own else str(defaults.tokenizer)
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
    words = _words(values)
    if _is_one_path(words):
        _need_file(words[0], f"{flag} path", fix)
        return str(words[0]), ()
    sources = parse_sources(words)
    for source in sources:
        _need_file(source.path, f"{flag} source {source.name!r}: path", fix)
    return " ".join(f"{s.name}={s.path}" + (f":{s.weight:g}" if s.weight is not None else "") for s in sources), sources


def _words(values: str | Path | list[str]) -> list[str]:
    return [str(values)] if isinstance(values, (str, Path)) else [str(v) for v in values]


def _is_one_path(words: list[str]) -> bool:
    """Whether ``--data``'s words are one plain path (an existing one even with '=' in it), not
    named sources."""
    word = words[0]
    return len(words) == 1 and not word.lstrip().startswith("{") and ("=" not in word or Path(word).exists())


RUN_RECORDS = ("checkpoints/", "metrics.jsonl", "summary.json", "emitted_ids.rank*.jsonl", "hf/")
"""What a run writes into its ``--output_dir``: an earlier run's, removed by ``--overwrite_output_dir``."""


def earlier_run(folder: Path) -> list[Path]:
    """The records of an earlier run in ``folder`` (:data:`RUN_RECORDS`), [] if there are none. An
    empty ``checkpoints/`` folder holds no checkpoint and does not count."""
    found = []
    for pattern in RUN_RECORDS:
        for path in sorted(folder.glob(pattern.rstrip("/"))):
            if path.is_dir() and not _entries(path):
                continue
            found.append(path)
    return found


def _entries(folder: Path) -> list[str]:
    """The names in ``folder``, [] if it is not there (also when rank 0 is removing it right now)."""
    try:
        return sorted(p.name for p in folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _resume(args: argparse.Namespace) -> str | None:
    """The checkpoint tag to resume (``--resume``; ``auto`` resolved), or None for a fresh run.

    The whole output-folder policy, the same on every rank (every rank reads the same folder, before
    any process group; the folder's state only changes when rank 0 removes an earlier run here, and
    then only what makes every rank start fresh anyway):

    * ``--resume [TAG]``: continue; the folder must hold checkpoints.
    * ``--resume auto``: 'latest' if the folder has it; else a fresh run, replacing an earlier run
      that saved no checkpoint and did not finish (a restarted attempt that failed before its first);
      a finished run (``summary.json`` or ``hf/``) is refused, as is a folder with checkpoints but no
      'latest' (a save that did not finish), naming its tags.
    * no ``--resume``: a folder that holds an earlier run (:func:`earlier_run`) is refused unless
      ``--overwrite_output_dir``, which removes it (rank 0): no second run is appended to its
      metrics.jsonl, no old checkpoint or summary outlives it. In a restarted attempt of the same job
      (``torchrun --max-restarts``, a SLURM requeue) ``--overwrite_output_dir`` means ``--resume auto``:
      a restart continues the run the first attempt started, never removes it.
    * Nothing is removed that the run reads (``--model``, ``--tokenizer``, the data, the configs): a
      removal that would is refused.
    """
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file; pass a folder (created if missing)")
    if args.overwrite_output_dir and _restart_attempt():
        print(f"odb: attempt {_restart_attempt()} of this job: --overwrite_output_dir read as --resume auto (a "
              "restart continues the run, it does not remove it)", flush=True)
        args.resume, args.overwrite_output_dir = "auto", False
    if args.resume and args.overwrite_output_dir:
        raise ValueError(f"--resume continues the run in --output_dir {out} and --overwrite_output_dir removes it: "
                         "pass one of them")
    checkpoints = out / "checkpoints"
    tags = _entries(checkpoints)
    if args.resume == "auto":
        if (checkpoints / "latest").is_file():
            return "latest"
        if tags:
            raise ValueError(f"--resume auto: {checkpoints} holds {tags} but no 'latest' (a save that did not "
                             "finish?): pass --resume TAG with one of them, or --overwrite_output_dir to start over")
    elif args.resume:
        if not tags:
            raise FileNotFoundError(f"--resume: no checkpoints in {checkpoints}; resume with the --output_dir of the "
                                    "run that saved them")
        return args.resume
    found = earlier_run(out)
    names = ", ".join(str(p.relative_to(out)) for p in found)
    if found and not (args.overwrite_output_dir or args.resume == "auto"):
        raise ValueError(f"--output_dir {out} holds an earlier run ({names}): pass --resume to continue it, "
                         "--overwrite_output_dir to start over (removes them), or another --output_dir")
    finished = [p.name for p in found if p.name in ("summary.json", "hf")]
    if args.resume == "auto" and finished:
        raise ValueError(f"--resume auto: --output_dir {out} holds a finished run ({', '.join(finished)}) and no "
                         "checkpoint to continue it from: pass --overwrite_output_dir to replace it, or another "
                         "--output_dir")
    _check_not_an_input(args, found)
    if found and os.environ.get("RANK", "0") == "0":
        _remove(found)
        print(f"odb: starting over in {out}: removed the earlier run's "
              f"{', '.join(str(p.relative_to(out)) for p in found)}", flush=True)
    return None


def _restart_attempt() -> int:
    """Which restart of this job this process runs in: torchrun's ``--max-restarts`` count, else
    SLURM's requeue count (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) or int(os.environ.get("SLURM_RESTART_COUNT") or 0)


_INPUTS = ("model", "tokenizer", "data", "eval_data", "data_config", "odb_config", "deepspeed_config",
           "fsdp_config", "lora")


def _check_not_an_input(args: argparse.Namespace, removed: list[Path]) -> None:
    """Raises ``ValueError`` where a path the run reads lies in what would be removed (a second stage
    trained from the first stage's export in the same folder, say)."""
    gone = [p.resolve() for p in removed]
    for flag in _INPUTS:
        value = getattr(args, flag, None)
        if not value or not isinstance(value, (str, list)):
            continue
        words = _words(value)  # (--data, --eval_data: one or more words)
        for word in words if _is_one_path(words) else [s.path for s in map(parse_source, words)]:
            path = Path(word).resolve()
            hit = next((g for g in gone if path == g or g in path.parents), None)
            if hit is not None:
                raise ValueError(f"--{flag} {word} lies in {hit}, which starting over in --output_dir "
                                 f"{args.output_dir} would remove: move it out of the folder, or pass another "
                                 "--output_dir")


def _remove(paths: list[Path]) -> None:
    """Removes an earlier run's records (rank 0, before any process group: no rank writes into the
    folder before rank 0 has joined it)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def parse_config(argv: list[str] | None = None, *, defaults: FileDefaults, recipe: Recipe | None = None
                 ) -> RunConfig:
    """The run's config from ``argv`` (default: ``sys.argv[1:]``) over ``recipe``'s (else the one
    ``--recipe`` names); raises naming the fix."""
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
    import torch

    world_size = _world_size()
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    backend = backends.get(args.backend)
    for name in backends.NAMES:
        other = backends.get(name)
        if name != backend.NAME and getattr(args, other.CONFIG_FLAG[2:]) is not None:
            raise ValueError(f"{other.CONFIG_FLAG} configures --backend {name}; pass --backend {name}, or drop "
                             f"{other.CONFIG_FLAG} and configure --backend {backend.NAME} with {backend.CONFIG_FLAG}")
    flag = backend.CONFIG_FLAG[2:]  # (FileDefaults names each backend's default file after its flag)
    source = getattr(args, flag)
    source = source if isinstance(source, Mapping) else source or getattr(defaults, flag)
    backend_settings = backend.load_settings(source, gas=batching.gas,
                                             world_size=world_size, use_bf16=use_bf16)
    model = _model(args, defaults)
    if args.save_adapter_only and model.lora is None:
        raise ValueError("--save_adapter_only saves a LoRA adapter: train with --lora, or drop the flag")
    data = _data(args)
    resume = _resume(args)
    optimization = flag_values(OptimizationSettings, args, skip=backends.NAMES)
    if optimization["lr"] is None:
        optimization["lr"] = default_lr(lora=model.lora is not None, bundled_model=defaults.is_demo_model(model.path))
    return RunConfig(
        model=model, data=data, batching=batching, run=run,
        optimization=OptimizationSettings(**optimization, **{backend.NAME: backend_settings}),
        checkpoints=CheckpointSettings(**{**flag_values(CheckpointSettings, args), "resume": resume}),
        logging=LoggingSettings(**flag_values(LoggingSettings, args)),
        preflight=PreflightSettings(**flag_values(PreflightSettings, args)))


def _named_recipe(argv: list[str]) -> str | None:
    """The recipe ``--recipe`` names in ``argv`` (the last one), None if none."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recipe", default=None)
    return pre.parse_known_args(argv)[0].recipe
