"""Atomic file writes: a file is either its old content or its complete new content, never half written.

Each write goes to its own temporary file beside the target (the name carries the process id and a random
suffix) and is moved over the target with ``os.replace``.  Unique names matter: two ``prismdp experiment``
processes sharing one output folder rewrite the same ``results.csv``, and with one shared temporary name a writer
could move the other's half-written file into place.

JSON is strict (RFC 8259): a non-finite float, which ``json.dumps`` would write as ``NaN`` / ``Infinity`` (rejected
by strict parsers: JavaScript's ``JSON.parse``, ``jq``, Go, Rust's serde), is written as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"``; Python's ``float()`` reads each back (:func:`dumps_json`).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

__all__ = ["atomic_path", "dumps_json", "write_text", "write_json"]

PathLike = Union[str, os.PathLike]


@contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its string (containers rebuilt, other values as they are)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else _NONFINITE[obj]
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_json(obj: Any, **kwargs) -> str:
    """``json.dumps`` that writes strict JSON: non-finite floats as strings (see the module docstring)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def write_json(path: PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = True, ensure_ascii: bool = True) -> None:
    write_text(path, dumps_json(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii) + "\n")
