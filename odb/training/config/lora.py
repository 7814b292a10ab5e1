"""LoRA settings (``--lora``, PEFT's ``LoraConfig`` fields in a JSON file), checked before peft sees
them: peft checks few of its keys and fails from inside the model build with a TypeError or
AttributeError; here a wrong value names the key and what it must be."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from odb.settings import check, check_int, check_number, field_names

__all__ = ["check_lora", "lora_keys"]


def lora_keys() -> list[str]:
    """The keys a LoRA JSON may hold: peft's ``LoraConfig`` fields (odb sets ``task_type``)."""
    from peft import LoraConfig

    return [name for name in field_names(LoraConfig) if name not in ("task_type", "peft_type")]


def _is_list_of(value: Any, is_item: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(is_item(item) for item in value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_regex(value: Any) -> bool:
    """peft matches a string of module names, and a pattern's keys, as a regular expression."""
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return True


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_LORA_BIAS = ("none", "all", "lora_only")


_MAX_LORA_RANK = 2**16


_LORA_INITS = ("gaussian", "eva", "olora", "pissa", "corda", "loftq", "orthogonal", "mica")


_NAMES = ("a module name regex, a list of names or null",
          lambda v: v is None or _is_str(v) and _is_regex(v) or _is_list_of(v, _is_str))


_LORA_SHAPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "target_modules": _NAMES,
    "exclude_modules": _NAMES,
    "modules_to_save": ("a list of module names or null", lambda v: v is None or _is_list_of(v, _is_str)),
    "target_parameters": ("a list of parameter names or null", lambda v: v is None or _is_list_of(v, _is_str)),
    "layers_to_transform": ("a layer index, a list of them or null",
                            lambda v: v is None or _is_count(v) or _is_list_of(v, _is_count)),
    "bias": (f"one of {_LORA_BIAS}", lambda v: v in _LORA_BIAS),
    "init_lora_weights": (f"true, false or one of {_LORA_INITS} or 'pissa_niter_<N>'",
                          lambda v: isinstance(v, bool) or v in _LORA_INITS
                          or _is_str(v) and re.fullmatch(r"pissa_niter_\d+", v) is not None),
    "rank_pattern": (f"an object of module name regex -> rank in [1, {_MAX_LORA_RANK}]",
                     lambda v: isinstance(v, dict) and all(_is_regex(k) and _is_count(r) and 1 <= r <= _MAX_LORA_RANK
                                                           for k, r in v.items())),
    "alpha_pattern": ("an object of module name regex -> alpha >= 0", lambda v: isinstance(v, dict) and all(
        _is_regex(k) and _is_number(a) and a >= 0 for k, a in v.items())),
    **{name: ("true or false", lambda v: isinstance(v, bool))
       for name in ("fan_in_fan_out", "inference_mode", "use_dora", "use_rslora")},
}
"""The shape of each LoRA key a user is likely to type (peft itself checks few of them, and fails
with a TypeError or AttributeError from inside when the model is built)."""


def check_lora(lora: Any) -> None:
    """The LoRA settings checked before peft sees them; then peft's own ``LoraConfig`` built once,
    its refusal naming the key."""
    check(isinstance(lora, Mapping), f"--lora must be a JSON object of LoraConfig fields, got {lora!r}")
    if "r" in lora:
        check_int("--lora 'r'", lora["r"], 1)
        check(lora["r"] <= _MAX_LORA_RANK, f"--lora 'r' must be <= {_MAX_LORA_RANK} (a rank above the model's "
                                             f"width adds nothing), got {lora['r']}")
    if "lora_alpha" in lora:
        check_number("--lora 'lora_alpha'", lora["lora_alpha"], 0)
    if "lora_dropout" in lora:
        check_number("--lora 'lora_dropout'", lora["lora_dropout"], 0, 1)
    for name, (shape, is_ok) in _LORA_SHAPES.items():
        check(name not in lora or is_ok(lora[name]), f"--lora '{name}' must be {shape}, got {lora.get(name)!r}")
    from peft import LoraConfig

    try:
        LoraConfig(task_type="CAUSAL_LM", **lora)
    except Exception as err:  # peft raises what it likes: name the keys it refuses on their own
        refused = [key for key in lora if not _lora_accepts(key, lora[key])] or sorted(lora)
        shown = ", ".join(f"'{key}'={lora[key]!r}" for key in refused)
        raise ValueError(f"--lora {shown}: peft's LoraConfig refuses it ({type(err).__name__}: {err})") from err


def _lora_accepts(key: str, value: Any) -> bool:
    from peft import LoraConfig

    try:
        LoraConfig(task_type="CAUSAL_LM", **{key: value})
    except Exception:
        return False
    return True
