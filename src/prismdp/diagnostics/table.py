"""CSV output of the diagnostics: a ``# caption: ...`` comment line, a header, then the rows."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

__all__ = ["write_csv", "read_csv"]


def _cell(x):
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float) or hasattr(x, "dtype"):
        x = float(x)
        return "nan" if math.isnan(x) else ("inf" if x == math.inf else f"{x:.10g}")
    return str(x)


def write_csv(path: str | Path, caption: str, columns: list[str], rows: list[list]) -> Path:
    """Write atomically; the caption goes on the first line as ``# caption: <text>`` (one line)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as fh:
        fh.write("# caption: " + " ".join(caption.split()) + "\n")
        w = csv.writer(fh)
        w.writerow(columns)
        for row in rows:
            if len(row) != len(columns):
                raise ValueError(f"row of {len(row)} cells for {len(columns)} columns")
            w.writerow([_cell(x) for x in row])
    os.replace(tmp, path)
    return path


def read_csv(path: str | Path) -> tuple[str, list[dict[str, str]]]:
    """``(caption, rows as dicts)`` of a file written by :func:`write_csv`."""
    with open(path, newline="") as fh:
        first = fh.readline()
        if not first.startswith("# caption: "):
            raise ValueError(f"{path}: the first line is not a '# caption: ' comment")
        return first[len("# caption: "):].rstrip("\n"), list(csv.DictReader(fh))
