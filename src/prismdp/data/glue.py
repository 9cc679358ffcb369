"""GLUE readers for the file layouts we meet offline, with the Hub as the online fallback (the tasks themselves:
:data:`prismdp.data.tasks.GLUE_TASKS`).

Layouts understood under ``data_dir`` (the GLUE root, e.g. ``/work/shared/data/glue``; the task folder itself is
accepted too), per task folder (official GLUE names: ``CoLA``, ``SST-2``, ``MRPC``, ``STS-B``, ``QQP``, ``MNLI``,
``QNLI``, ``RTE``):

* Hugging Face ``datasets`` exports (preferred, they carry the exact HF rows and integer labels):
  ``hf_<split>.parquet`` or a ``save_to_disk`` folder ``hf_<split>/`` holding ``data-*.arrow`` (Arrow IPC stream).
* The official GLUE download (``train.tsv``, ``dev.tsv``, MNLI ``dev_matched.tsv`` / ``dev_mismatched.tsv``):
  UTF-8 (MRPC starts with a BOM), tab-separated, **no quoting** (``csv.QUOTE_NONE``; sentences contain ``"``),
  CoLA without a header row.
* PowerfulPromptFT train subsets ``train_subset_*.json`` (MNLI, QNLI, QQP; used for ``train`` only when neither of
  the above is present): one JSON object ``{"0": {"text_a", "text_b", "label"}, ...}``; all such files in the folder
  are concatenated (sorted by file name, records in index order) and a warning says that this is a subset.

Splits: ``train``, ``validation`` (``dev`` is an alias); MNLI has ``validation_matched`` and
``validation_mismatched`` instead of ``validation``.  GLUE ``test`` splits carry no labels and are refused.

Labels are returned as the Hugging Face ``datasets`` integers (the order of ``GlueTask.label_names``), or a float
in [0, 5] for STS-B.  Every problem with the data raises :class:`GlueDataError` (a ``ValueError``) naming the file and
the fix; a missing file raises ``FileNotFoundError`` listing what was looked for.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from .example import Example
from .files import read_text
from .tasks import GLUE_TASKS, GlueTask, glue_task  # the registry (re-exported here for the readers' users)

__all__ = [
    "GlueTask",
    "GlueDataError",
    "GLUE_TASKS",
    "HF_DATASET_ID",
    "glue_task",
    "load_glue",
]

#: The Hub id of the ``glue`` dataset (``load_dataset("glue", task)`` resolves to it).
HF_DATASET_ID = "nyu-mll/glue"

_STSB_MIN, _STSB_MAX = 0.0, 5.0


class GlueDataError(ValueError):
    """GLUE data that is present but unusable (wrong columns, bad labels, empty, malformed)."""


_SPLIT_ALIASES = {"dev": "validation", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"}
_TSV_NAMES = {
    "train": "train.tsv",
    "validation": "dev.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
}
_FORMATS = ("auto", "hf", "tsv", "subset")


def _canonical_split(task: GlueTask, split: str) -> str:
    s = _SPLIT_ALIASES.get(str(split).strip().lower(), str(split).strip().lower())
    if s == "test" or s.startswith("test_"):
        raise ValueError(f"GLUE {task.name} split {split!r}: GLUE test splits have no public labels; "
                         f"use one of {', '.join(task.splits)}")
    if s not in task.splits:
        hint = ""
        if task.name == "mnli" and s == "validation":
            hint = " (MNLI has two validation sets: choose validation_matched or validation_mismatched)"
        raise ValueError(f"GLUE {task.name} has no split {split!r}{hint}; available: {', '.join(task.splits)}")
    return s


# ----------------------------------------------------------------------------------------------------------------
# label / text validation


def _parse_label(task: GlueTask, raw, where: str) -> Union[int, float]:
    """Map a raw label (int, float, label name, numeric string) to the HF label; raise on anything outside the set."""
    if task.is_regression:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise GlueDataError(f"{where}: STS-B score {raw!r} is not a number") from None
        if not math.isfinite(value) or not (_STSB_MIN <= value <= _STSB_MAX):
            raise GlueDataError(f"{where}: STS-B score {raw!r} outside [{_STSB_MIN:g}, {_STSB_MAX:g}]")
        return value
    names = task.label_names
    assert names is not None
    if isinstance(raw, str):
        s = raw.strip()
        if s in names:
            return names.index(s)
        try:
            value = int(s)
        except ValueError:
            raise GlueDataError(
                f"{where}: label {raw!r} is not in the {task.name} label set {list(names)} "
                f"(integers 0..{task.num_labels - 1} are accepted too)") from None
    elif isinstance(raw, bool) or raw is None:
        raise GlueDataError(f"{where}: label {raw!r} is not a valid {task.name} label")
    elif isinstance(raw, float):
        if not raw.is_integer():
            raise GlueDataError(f"{where}: label {raw!r} is not an integer class index for {task.name}")
        value = int(raw)
    else:
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise GlueDataError(f"{where}: label {raw!r} is not a valid {task.name} label") from None
    if not 0 <= value < task.num_labels:
        extra = " (-1 marks an unlabelled GLUE test row)" if value == -1 else ""
        raise GlueDataError(
            f"{where}: label {value} is outside the {task.name} label set 0..{task.num_labels - 1} "
            f"{list(names)}{extra}")
    return value


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise GlueDataError(f"{where}: field {field!r} is {value!r}, expected a string")
    return value


def _finish(task: GlueTask, examples: List[Example], source: str) -> List[Example]:
    if not examples:
        raise GlueDataError(f"{source}: no examples (empty {task.name} data)")
    return examples


# ----------------------------------------------------------------------------------------------------------------
# readers


def _read_tsv(task: GlueTask, path: Path) -> List[Example]:
    col_a, col_b, col_label = task.tsv_columns
    out: List[Example] = []
    # utf-8-sig strips the BOM that starts MRPC's files; harmless elsewhere.
    text = read_text(path, f"the GLUE {task.name} TSV file", GlueDataError, encoding="utf-8-sig")
    with io.StringIO(text, newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if task.tsv_has_header:
            header = next(reader, None)
            if header is None:
                raise GlueDataError(f"{path}: empty file (expected a header row and {task.name} examples)")
            wanted = [c for c in (col_a, col_b, col_label) if c is not None]
            missing = [c for c in wanted if c not in header]
            if missing:
                raise GlueDataError(
                    f"{path}: wrong columns for {task.name}: missing {missing}; header is {header}; expected the "
                    f"official GLUE {task.dir_name} TSV with columns {wanted}")
            idx = {c: header.index(c) for c in wanted}
            ncols = len(header)
        else:
            idx = {c: c for c in (col_a, col_b, col_label) if c is not None}
            ncols = task.tsv_num_columns
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            where = f"{path}:{line}"
            if len(row) != ncols:
                raise GlueDataError(
                    f"{where}: {len(row)} tab-separated columns, expected {ncols} for the {task.name} TSV "
                    f"(was the file re-saved with quoting or a different delimiter?)")
            text_a = row[idx[col_a]]
            text_b = row[idx[col_b]] if col_b is not None else None
            label = _parse_label(task, row[idx[col_label]], where)
            out.append(Example(text_a, text_b, label))
    return _finish(task, out, str(path))


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading the Hugging Face parquet/arrow GLUE files needs pyarrow: pip install pyarrow") from e
    return pyarrow


def _examples_from_columns(task: GlueTask, columns: Dict[str, Sequence], source: str) -> List[Example]:
    wanted = list(task.text_fields) + ["label"]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise GlueDataError(
            f"{source}: wrong columns for {task.name}: missing {missing}; found {sorted(columns)}; "
            f"expected the Hugging Face glue/{task.name} schema {wanted}")
    a = columns[task.text_fields[0]]
    b = columns[task.text_fields[1]] if task.is_pair else None
    labels = columns["label"]
    out = []
    for i in range(len(labels)):
        where = f"{source} row {i}"
        text_a = _text(a[i], where, task.text_fields[0])
        text_b = _text(b[i], where, task.text_fields[1]) if b is not None else None
        out.append(Example(text_a, text_b, _parse_label(task, labels[i], where)))
    return _finish(task, out, source)


def _table_to_examples(task: GlueTask, table, source: str) -> List[Example]:
    return _examples_from_columns(task, {name: table.column(name).to_pylist() for name in table.column_names}, source)


def _read_parquet(task: GlueTask, path: Path) -> List[Example]:
    pa = _pyarrow()
    try:
        table = pa.parquet.read_table(path)
    except Exception as e:
        raise GlueDataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    return _table_to_examples(task, table, str(path))


def _read_arrow_dir(task: GlueTask, folder: Path) -> List[Example]:
    pa = _pyarrow()
    files = sorted(folder.glob("data-*.arrow")) or sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.arrow file (expected a datasets save_to_disk folder with "
                                f"data-00000-of-0000N.arrow)")
    tables = []
    for p in files:
        try:
            with pa.OSFile(str(p), "rb") as src:
                try:
                    tables.append(pa.ipc.open_stream(src).read_all())
                except pa.ArrowInvalid:
                    src.seek(0)
                    tables.append(pa.ipc.open_file(src).read_all())
        except Exception as e:
            raise GlueDataError(f"{p}: not a readable Arrow IPC file ({type(e).__name__}: {e})") from e
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    return _table_to_examples(task, table, str(folder))


def _read_subset_json(task: GlueTask, path: Path) -> List[Example]:
    try:
        data = json.loads(read_text(path, f"the GLUE {task.name} subset JSON file", GlueDataError))
    except json.JSONDecodeError as e:
        raise GlueDataError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise GlueDataError(f"{path}: expected a JSON object {{\"0\": {{\"text_a\", \"text_b\", \"label\"}}, ...}}, "
                            f"got {type(data).__name__}")
    try:
        keys = sorted(data, key=int)
    except ValueError:
        raise GlueDataError(f"{path}: keys must be row indices \"0\"..\"N-1\"") from None
    need = ("text_a", "text_b", "label") if task.is_pair else ("text_a", "label")
    out = []
    for k in keys:
        rec = data[k]
        where = f"{path} record {k!r}"
        if not isinstance(rec, dict):
            raise GlueDataError(f"{where}: expected an object with keys {list(need)}")
        missing = [c for c in need if c not in rec]
        if missing:
            raise GlueDataError(f"{where}: wrong columns: missing {missing}, found {sorted(rec)}")
        text_b = _text(rec["text_b"], where, "text_b") if task.is_pair else None
        out.append(Example(_text(rec["text_a"], where, "text_a"), text_b, _parse_label(task, rec["label"], where)))
    return _finish(task, out, str(path))


def _load_from_hub(task: GlueTask, split: str) -> List[Example]:
    try:
        import datasets  # noqa: F401  (optional dependency, online users only)
    except ImportError as e:
        raise ImportError(
            f"load_glue({task.name!r}, {split!r}) without data_dir downloads GLUE with the `datasets` package, "
            f"which is not installed: pip install datasets, or pass data_dir=<GLUE folder> holding "
            f"{task.dir_name}/{_TSV_NAMES[split]} (official GLUE layout) or {task.dir_name}/hf_{split}.parquet") from e
    try:
        ds = datasets.load_dataset(HF_DATASET_ID, task.name, split=split)
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        raise GlueDataError(
            f"could not load GLUE {task.name}/{split} from the Hugging Face Hub ({HF_DATASET_ID}): "
            f"{type(e).__name__}: {e}. "
            + ("HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set. " if offline else "")
            + f"Offline, pass data_dir=<GLUE folder> holding {task.dir_name}/{_TSV_NAMES[split]} or "
              f"{task.dir_name}/hf_{split}.parquet") from e
    return _examples_from_columns(task, {c: ds[c] for c in ds.column_names}, f"{HF_DATASET_ID}/{task.name}[{split}]")


def _task_dir(task: GlueTask, data_dir: Path) -> Path:
    if not data_dir.is_dir():
        raise FileNotFoundError(f"GLUE data_dir {data_dir} does not exist or is not a folder")
    for name in (task.dir_name, task.name, task.name.upper()):
        if (data_dir / name).is_dir():
            return data_dir / name
    if data_dir.name.lower().replace("-", "") == task.name:
        return data_dir
    raise FileNotFoundError(
        f"no {task.name} folder under {data_dir}: expected {data_dir / task.dir_name}/ (official GLUE folder "
        f"names: {', '.join(t.dir_name for t in GLUE_TASKS.values())})")


def load_glue(task: str, split: str, data_dir: Optional[Union[str, os.PathLike]] = None,
              fmt: str = "auto") -> List[Example]:
    """Read one labelled GLUE split as a list of :class:`Example`.

    ``data_dir`` is the GLUE root holding the task folders (``SST-2/``, ``MNLI/``, ...) or a task folder itself;
    ``None`` downloads ``nyu-mll/glue`` with ``datasets`` (online users).  ``fmt`` forces a file kind:
    ``"hf"`` (``hf_<split>.parquet`` or ``hf_<split>/`` arrow folder), ``"tsv"`` (official GLUE files),
    ``"subset"`` (``train_subset_*.json``, train only), or ``"auto"``: the first of hf, tsv, subset that exists.
    """
    t = glue_task(task)
    s = _canonical_split(t, split)
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {_FORMATS}, got {fmt!r}")
    if data_dir is None:
        if fmt != "auto":
            raise ValueError(f"fmt={fmt!r} needs data_dir (fmt only chooses between local files)")
        return _load_from_hub(t, s)

    if fmt == "subset" and s != "train":
        raise ValueError(f"fmt='subset' (PowerfulPromptFT train_subset_*.json) exists for the train split only, "
                         f"not {s!r}")
    folder = _task_dir(t, Path(data_dir).expanduser())
    candidates = []  # (kind, path, reader)
    if fmt in ("auto", "hf"):
        candidates.append(("hf", folder / f"hf_{s}.parquet", _read_parquet))
        candidates.append(("hf", folder / f"hf_{s}", _read_arrow_dir))
    if fmt in ("auto", "tsv"):
        candidates.append(("tsv", folder / _TSV_NAMES[s], _read_tsv))
    for _, path, reader in candidates:
        if path.exists():
            folder_expected = reader is _read_arrow_dir
            if path.is_dir() != folder_expected:
                raise GlueDataError(
                    f"{path} is a {'file' if folder_expected else 'folder'}, but GLUE {t.name} {s} data there must be "
                    f"a {'datasets save_to_disk folder' if folder_expected else 'file'}: move it away or replace it")
            return reader(t, path)
    subset_files = sorted(folder.glob("train_subset_*.json")) if s == "train" else []
    if fmt in ("auto", "subset") and subset_files:
        return _load_subsets(t, subset_files)

    looked = [str(p) for _, p, _ in candidates]
    if fmt in ("auto", "subset") and s == "train":
        looked.append(str(folder / "train_subset_*.json"))
    raise FileNotFoundError(
        f"no GLUE {t.name} {s} data found; looked for: {', '.join(looked)}. Expected the official GLUE layout "
        f"({t.dir_name}/{_TSV_NAMES[s]}), a Hugging Face export ({t.dir_name}/hf_{s}.parquet or a "
        f"datasets save_to_disk folder {t.dir_name}/hf_{s}/)"
        + (", or PowerfulPromptFT train_subset_*.json" if s == "train" else "")
        + "; or pass data_dir=None to download it with `datasets`.")


def _load_subsets(task: GlueTask, files: List[Path]) -> List[Example]:
    out: List[Example] = []
    for p in files:
        out.extend(_read_subset_json(task, p))
    warnings.warn(
        f"GLUE {task.name} train: using {len(out)} examples from {', '.join(p.name for p in files)} "
        f"(a subset of the GLUE train split, not the full split)", UserWarning, stacklevel=3)
    return out
