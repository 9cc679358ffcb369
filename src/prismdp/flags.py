"""Command-line flags generated from dataclass fields (import-light: no torch).

A settings dataclass declares each field with :func:`option` (its help, and optionally its choices and its flag's
spelling); :func:`add_config_flags` turns the fields into ``--field-name`` flags.  ``prismdp train`` (from
:class:`~prismdp.train.config.TrainConfig`) and ``prismdp diagnose`` (from the same TrainConfig fields and
:class:`~prismdp.diagnostics.settings.Settings`) are built this way, so a setting is declared once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Mapping, Sequence

__all__ = ["option", "add_config_flags", "csv_list", "yaml_mapping", "integer", "finite_float", "integers",
           "finite_floats"]

INT_LIMIT = 2**63  # an integer flag's value lies in (-2^63, 2^63): a seed, a tensor size, a step count


def option(default, help: str, *, flag: str | None = None, choices: tuple | None = None, factory=None):
    """A dataclass field with its command-line help (``flag``: the flag's spelling, e.g. ``--no-dp`` for a switch
    that turns a default-True field off)."""
    meta = {"help": help, "flag": flag, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def integer(text: str) -> int:
    """An integer flag's value (argparse ``type``): digits only, below :data:`INT_LIMIT` in size."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if abs(value) >= INT_LIMIT:
        raise argparse.ArgumentTypeError(f"{text} is too large (at most {INT_LIMIT - 1})")
    return value


def finite_float(text: str) -> float:
    """A number flag's value (argparse ``type``): a finite float (``nan`` and ``inf`` refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def csv_list(text: str) -> list[str]:
    """A comma-separated flag's items (argparse ``type``); an empty list is refused (it would select nothing, or,
    for a filter, silently everything)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def integers(text: str) -> list[int]:
    """A comma-separated list of :func:`integer` values (argparse ``type``); an empty list is refused."""
    return [integer(t) for t in csv_list(text)]


def finite_floats(text: str) -> list[float]:
    """A comma-separated list of :func:`finite_float` values (argparse ``type``); an empty list is refused."""
    return [finite_float(t) for t in csv_list(text)]


def yaml_mapping(text: str) -> dict:
    import yaml

    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{preset: reference}}', got {text!r}")
    return value


def _typed_list(kind: str):
    return {"list[int]": integers, "list[float]": finite_floats}.get(kind.split(" |")[0], csv_list)


def add_config_flags(parser, cls, only: Sequence[str] | None = None, defaults: Mapping | None = None) -> None:
    """One flag per field of the dataclass ``cls`` declared with :func:`option` (or only the fields ``only``, in
    that order): lists are comma-separated, mappings YAML, booleans switches.  Unset flags stay unset
    (``argparse.SUPPRESS``), so a config file and the dataclass defaults fill them.  ``defaults``: the front end's
    own defaults for some fields, shown in their help instead of the field's ``(default ...)``."""
    fields = {f.name: f for f in dataclasses.fields(cls) if "help" in f.metadata}
    for name in only if only is not None else list(fields):
        f = fields[name]
        meta, kind = f.metadata, str(f.type)
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        help = meta.get("help")
        if defaults and name in defaults:
            help = re.sub(r"\s*\(default[^)]*\)", "", help) + f" (default {defaults[name]:g})"
        kw = {"dest": f.name, "help": help, "default": argparse.SUPPRESS}
        if kind == "bool":
            kw["action"] = "store_false" if f.default else "store_true"
        elif kind.startswith("list"):
            kw["type"] = _typed_list(kind)
        elif kind.startswith("dict"):
            kw["type"] = yaml_mapping
        else:
            kw["type"] = integer if kind.startswith("int") else finite_float if kind.startswith("float") else str
            if meta.get("choices"):
                kw["choices"] = list(meta["choices"])
        parser.add_argument(flag, **kw)
