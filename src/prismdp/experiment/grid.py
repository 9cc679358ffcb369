"""Experiment grids: a YAML file -> one :class:`~prismdp.train.config.TrainConfig` per cell.

A grid is methods x privacy settings x tasks x seeds.  The file (keys with dashes or underscores)::

    name: paper-gemma3-4b            # optional, shown in the tables
    output: runs/paper               # OUT (relative to the working directory); `--output` overrides it
    base:                            # TrainConfig keys shared by every cell
      model: google/gemma-3-4b-pt
      rank: 16
      ...
    tasks:                           # grid task id -> TrainConfig overrides (`task` defaults to the id)
      glue8: {task: glue8, data: ../../shared/data/glue, steps: 500, lr: {prism: 2.0e-4, lamb: 5.0e-3, ...}}
      math10k: {task: instruct, data: ../../shared/data/math/math_10k.json, eval_tasks: math, steps: 300}
    methods: [ffa, lora-rite, dp-adamw, lora-plus, lamb, prism]    # or {method: TrainConfig overrides}
    privacy: [non-dp, 6, 3]          # target epsilons; non-dp (or null) = the same run without clipping/noise
    seeds: [42]
    labels: {lora-rite: RITE}        # optional display names of methods (default: each method's registered label)
    columns: [cola, sst2, ...]       # optional column order of the tables
    exclude: ["*__ffa__nondp__*"]    # optional: cell-id patterns (fnmatch) left out of the grid
    lrs: [3.0e-4, 1.0e-3, 3.0e-3]    # optional learning-rate axis (cell ids gain __lr<value>); a methods entry may
                                     # have its own (e.g. plain SGD: {method: prism, adaptive: false, lrs: [...]})
    tune: {by: val, widen: 2}        # optional: pick each (task, method, setting)'s rate on eval set `on` with the
                                     # first seed, then run the other seeds at it (prismdp.experiment.tuning)
    compare: prism                   # optional: the method the paired comparisons are about (default: prism)

A ``methods`` entry may be a variant of a registered method: ``prism-ref: {method: prism, method_kwargs: {preset:
reference}}`` (its id names the cells and the table rows).

A cell's values are ``base``, then ``methods[m]``, then ``tasks[t]``, then the command line's ``--set KEY=VALUE``,
then the cell's own ``method``, ``dp``/``epsilon``, ``seed``, ``lr`` (on the lr axis) and ``output = OUT/<cell id>``.  ``lr`` may be a
mapping ``{method: lr}`` at any level (the paper's rates depend on method and task); a cell whose method is not in
the mapping is an error.  Relative ``data`` / ``eval_data`` paths, and a ``model`` starting with ``.``, are
resolved against the folder of the YAML file.  Cell ids: ``<task id>__<method>__<nondp|eps3>__seed<seed>``, or
``<task id>__<method>__<nondp|eps3>__lr<lr>__seed<seed>`` with an lr axis.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..train.config import ConfigError, TrainConfig
from .tuning import Tune

__all__ = ["Setting", "Cell", "Experiment", "load_experiment", "parse_setting", "parse_set_overrides"]
_TOP_KEYS = {"name", "output", "base", "tasks", "methods", "privacy", "seeds", "labels", "columns", "exclude", "lrs",
             "tune", "compare"}
_PATH_KEYS = ("data", "eval_data")
_CELL_KEYS = ("method", "dp", "epsilon", "seed", "output")  # set by the grid, not by the layers
_NONDP = {"non-dp", "nondp", "non_dp", "none", "no-dp", "off", "false"}


@dataclass(frozen=True)
class Setting:
    """One privacy setting of the grid: ``epsilon`` None = non-private."""

    epsilon: Optional[float]

    @property
    def dp(self) -> bool:
        return self.epsilon is not None

    @property
    def key(self) -> str:
        return "nondp" if self.epsilon is None else f"eps{self.epsilon:g}"

    @property
    def label(self) -> str:
        return "Non-DP" if self.epsilon is None else f"ε={self.epsilon:g}"

    @property
    def tex(self) -> str:
        return "Non-DP" if self.epsilon is None else f"$\\varepsilon={self.epsilon:g}$"


def parse_setting(value: Any) -> Setting:
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONDP) or value is False:
        return Setting(None)
    try:
        eps = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"privacy: {value!r} is neither a target epsilon nor non-dp") from None
    if not eps > 0:
        raise ConfigError(f"privacy: epsilon must be > 0, got {value!r}")
    return Setting(eps)


def cell_id(task_id: str, method: str, setting: Setting, seed: int, lr: Optional[float] = None) -> str:
    lr_part = "" if lr is None else f"__lr{lr:g}"
    return f"{task_id}__{method}__{setting.key}{lr_part}__seed{seed}"


@dataclass(frozen=True)
class Cell:
    task_id: str
    method: str  # the grid's method id (a registered method, or a variant of one)
    setting: Setting
    seed: int
    config: TrainConfig = field(compare=False, repr=False)
    lr: Optional[float] = None  # the value on the grid's lr axis (None without one)

    @property
    def id(self) -> str:
        return cell_id(self.task_id, self.method, self.setting, self.seed, self.lr)

    @property
    def group(self) -> Tuple[str, str, str]:
        """(task id, method id, setting key): the cells that differ only by seed and learning rate."""
        return self.task_id, self.method, self.setting.key


@dataclass
class Experiment:
    path: Optional[Path]
    name: str
    output: str
    base: Dict[str, Any]
    tasks: Dict[str, Dict[str, Any]]
    methods: Dict[str, Dict[str, Any]]
    settings: List[Setting]
    seeds: List[int]
    labels: Dict[str, str]
    columns: Optional[List[str]] = None
    overrides: Dict[str, Any] = field(default_factory=dict)
    exclude: List[str] = field(default_factory=list)
    lrs: Optional[List[float]] = None
    tune: Optional[Tune] = None
    compare: Optional[str] = None
    method_lrs: Dict[str, List[float]] = field(default_factory=dict)  # a method's own lr axis (its entry's `lrs`)

    def lrs_for(self, method: str) -> Optional[List[float]]:
        """The learning-rate axis of ``method``: its own ``lrs`` if its entry has one, else the grid's."""
        return self.method_lrs.get(method, self.lrs)

    def excluded(self, cell_id: str) -> bool:
        return any(fnmatch.fnmatchcase(cell_id, pat) for pat in self.exclude)

    def label(self, method: str) -> str:
        """The file's ``labels``, else a registered method's own label (a variant's id names it)."""
        from ..engine import METHODS

        return self.labels.get(method, METHODS[method].label if method in METHODS else method)

    def check_seeds(self, seeds: Optional[Sequence[int]]) -> None:
        """A :class:`ConfigError` naming the seeds of ``seeds`` (``--seeds``) that the experiment does not have."""
        unknown = [s for s in (seeds or ()) if s not in self.seeds]
        if unknown:
            raise ConfigError(f"--seeds: {unknown} not in the experiment ({', '.join(map(str, self.seeds))})")

    def cells(self, output: Optional[str] = None, *, tasks: Optional[Sequence[str]] = None,
              methods: Optional[Sequence[str]] = None, settings: Optional[Sequence[Setting]] = None,
              seeds: Optional[Sequence[int]] = None) -> List[Cell]:
        """All cells (or the selected ones), each with its validated TrainConfig; order: task, setting, method, seed."""
        out_root = Path(output if output is not None else self.output)
        for kind, chosen, known in (("task", tasks, self.tasks), ("method", methods, self.methods)):
            unknown = [c for c in (chosen or ()) if c not in known]
            if unknown:
                raise ConfigError(f"--{kind}s: {unknown} not in the experiment ({', '.join(known)})")
        for s in settings or ():
            if s not in self.settings:
                have = ", ".join(x.key for x in self.settings)
                raise ConfigError(f"--privacy: {s.key} not in the experiment ({have})")
        self.check_seeds(seeds)
        cells = []
        for task_id in self.tasks:
            if tasks and task_id not in tasks:
                continue
            for setting in self.settings:
                if settings and setting not in settings:
                    continue
                for method in self.methods:
                    if methods and method not in methods:
                        continue
                    for seed in self.seeds:
                        for lr in self.lrs_for(method) or [None]:
                            if (seeds and seed not in seeds) or self.excluded(
                                    cell_id(task_id, method, setting, seed, lr)):
                                continue
                            cells.append(self.cell(task_id, method, setting, seed, out_root, lr))
        return cells

    def cell(self, task_id: str, method: str, setting: Setting, seed: int, out_root: Path,
             lr: Optional[float] = None) -> Cell:
        """The cell of one grid point (``lr``: a value on the lr axis, which overrides every layer's ``lr``)."""
        values: Dict[str, Any] = {}
        for layer in (self.base, self.methods[method], self.tasks[task_id], self.overrides):
            values.update(copy.deepcopy(layer))
        values.setdefault("task", task_id)
        values.setdefault("method", method)  # a variant names its registered method
        cid = cell_id(task_id, method, setting, seed, lr)
        if lr is not None:
            values["lr"] = float(lr)
        if isinstance(values.get("lr"), dict):
            table = values["lr"]
            if method not in table:
                raise ConfigError(f"{cid}: lr is a per-method mapping without an entry for {method!r} "
                                  f"(has {', '.join(table)})")
            values["lr"] = table[method]
        values.update(dp=setting.dp, seed=int(seed), output=str(out_root / cid))
        if setting.dp:
            values["epsilon"] = setting.epsilon
        try:
            cfg = TrainConfig.from_dict(values, source=f"cell {cid}")
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"cell {cid}: {e}") from None
        return Cell(task_id, method, setting, int(seed), cfg, None if lr is None else float(lr))


def _mapping(d: Any, where: str) -> Dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    return {str(k): v for k, v in d.items()}


def _norm_keys(d: Any, where: str) -> Dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    return {str(k).replace("-", "_"): v for k, v in d.items()}


def _parse_lrs(raw: Any, where: str) -> List[float]:
    try:
        lrs = sorted({float(v) for v in (raw if isinstance(raw, (list, tuple)) else [raw])})
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a list of learning rates, got {raw!r}") from None
    if not lrs or min(lrs) <= 0:
        raise ConfigError(f"{where}: expected positive learning rates, got {raw!r}")
    return lrs


def _resolve_paths(values: Dict[str, Any], folder: Optional[Path]) -> Dict[str, Any]:
    if folder is None:
        return values
    out = dict(values)
    for key in _PATH_KEYS:
        v = out.get(key)
        if isinstance(v, str) and v and not Path(v).expanduser().is_absolute():
            out[key] = str((folder / v).resolve())
    m = out.get("model")
    if isinstance(m, str) and m.startswith("."):
        out["model"] = str((folder / m).resolve())
    return out


def _check_layer(values: Dict[str, Any], where: str, allowed: Sequence[str] = ()) -> None:
    import dataclasses

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid TrainConfig keys: {sorted(known)}")
    fixed = sorted(set(values) & set(_CELL_KEYS) - set(allowed))
    if fixed:
        raise ConfigError(f"{where}: {fixed} are set by the grid (methods / privacy / seeds / --output), "
                          "not per layer")


def parse_set_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """``["steps=2", "eval-examples=20"]`` -> ``{"steps": 2, "eval_examples": 20}`` (values parsed as YAML)."""
    import yaml

    out: Dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        value = yaml.safe_load(v) if v.strip() else None
        if isinstance(value, str):  # YAML 1.1 reads 5e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        out[k.strip().replace("-", "_")] = value
    return out


def load_experiment(source: Any, overrides: Optional[Dict[str, Any]] = None) -> Experiment:
    """Read and validate an experiment YAML/JSON file (or a mapping); every cell's TrainConfig is checked."""
    path: Optional[Path] = None
    if isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"experiment file {str(path)!r} does not exist")
        import json

        import yaml

        text = path.read_text()
        raw = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    raw = _norm_keys(raw, str(path or "experiment"))
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{path or 'experiment'}: unknown top-level key(s) {unknown}; valid: {sorted(_TOP_KEYS)}")
    folder = path.resolve().parent if path is not None else None

    base = _resolve_paths(_norm_keys(raw.get("base"), "base"), folder)
    base_seed = base.pop("seed", 42)  # base.seed is only the default of `seeds`
    _check_layer(base, "base")
    tasks_raw = raw.get("tasks")
    if isinstance(tasks_raw, (list, tuple)):
        tasks_raw = {t: {} for t in tasks_raw}
    tasks = {str(k): _resolve_paths(_norm_keys(v, f"tasks.{k}"), folder)
             for k, v in _mapping(tasks_raw, "tasks").items()} if tasks_raw else {}
    if not tasks:
        raise ConfigError("tasks: the experiment needs at least one task")
    for k, v in tasks.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", k) or "__" in k:
            raise ConfigError(f"tasks: id {k!r} must be letters, digits, '.', '-' or '_' (no '__')")
        _check_layer(v, f"tasks.{k}")
    methods_raw = raw.get("methods", ["prism"])
    if isinstance(methods_raw, (list, tuple)):
        methods = {str(m): {} for m in methods_raw}
    else:
        methods = {k: _norm_keys(v, f"methods.{k}") for k, v in _mapping(methods_raw, "methods").items()}
    from ..engine import METHODS

    method_lrs = {m: _parse_lrs(v.pop("lrs"), f"methods.{m}.lrs") for m, v in methods.items() if "lrs" in v}
    for m, v in methods.items():
        if v.get("method", m) not in METHODS:
            what = f"method {v['method']!r} of variant {m!r}" if "method" in v else f"method {m!r}"
            raise ConfigError(f"methods: unknown {what}; choose from {sorted(METHODS)} (a variant with another id "
                              "names its method: {method: prism, ...})")
        if "__" in m:
            raise ConfigError(f"methods: id {m!r} must not contain '__'")
        _check_layer(v, f"methods.{m}", allowed=("method",))
    settings_raw = raw.get("privacy", [3])
    settings_raw = settings_raw if isinstance(settings_raw, (list, tuple)) else [settings_raw]
    settings = []
    for v in settings_raw:
        s = parse_setting(v)
        if s in settings:
            raise ConfigError(f"privacy: {s.key} listed twice")
        settings.append(s)
    seeds_raw = raw.get("seeds", [base_seed])
    seeds_raw = seeds_raw if isinstance(seeds_raw, (list, tuple)) else [seeds_raw]
    if any(isinstance(s, bool) or not isinstance(s, int) for s in seeds_raw) or len(set(seeds_raw)) != len(seeds_raw):
        raise ConfigError(f"seeds: expected distinct integers, got {seeds_raw!r}")
    labels = {str(k): str(v) for k, v in (raw.get("labels") or {}).items()}
    columns = raw.get("columns")
    if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
        raise ConfigError("columns: expected a list of column names")
    exclude = raw.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError("exclude: expected a list of cell-id patterns such as '*__ffa__nondp__*'")
    over = _resolve_paths(dict(overrides or {}), Path.cwd())
    _check_layer(over, "--set")
    lrs = _parse_lrs(raw["lrs"], "lrs") if raw.get("lrs") is not None else None
    if method_lrs and lrs is None:
        raise ConfigError(f"methods: {sorted(method_lrs)} have their own lrs, but the grid has no `lrs` axis")
    tune = Tune.parse(raw.get("tune"), lrs) if raw.get("tune") is not None else None
    compare = raw.get("compare", "prism" if "prism" in methods else None)
    if compare is not None and compare not in methods:
        raise ConfigError(f"compare: {compare!r} is not one of the methods ({', '.join(methods)})")
    exp = Experiment(path, str(raw.get("name") or (path.stem if path else "experiment")),
                     str(raw.get("output") or f"runs/{path.stem if path else 'experiment'}"), base, tasks, methods,
                     settings, [int(s) for s in seeds_raw], labels, columns, over, list(exclude), lrs, tune, compare,
                     method_lrs)
    cells = exp.cells()
    if not cells:
        raise ConfigError(f"exclude: the patterns {exclude} leave no cell in the grid")
    if tune is not None:
        tune.check_split(cells)  # before any run: a tuning set the tables report, or no val split, is refused
    return exp
