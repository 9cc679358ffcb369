"""The run configuration: one dataclass, validated on construction, loadable from YAML/JSON, flags override it."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..flags import option as _opt  # a field with its command-line help: prismdp train's flags

__all__ = ["TrainConfig", "ConfigError", "FAMILY_DEFAULTS", "load_config_file"]


# Defaults that depend on the task family: the paper's Appendix B for GLUE-style and Math tasks; for the built-in
# demo task, settings that learn within a few minutes on 2 CPU cores at epsilon 3 (a larger batch, a small rank).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "glue": {"steps": 500, "batch_size": 64.0, "rank": 16, "alpha": 16.0},
    "math": {"steps": 300, "batch_size": 64.0, "rank": 16, "alpha": 16.0},
    "demo": {"steps": 100, "batch_size": 128.0, "rank": 4, "alpha": 16.0},
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


@dataclass
class TrainConfig:
    """One training run.  Every field is a ``prismdp train`` flag (``--field-name``) and a config-file key."""

    model: str | None = _opt(None, "local folder, hub id or .gguf file (default: packaged MiniLM / SmolLM2)")
    task: str = _opt("synthetic", "synthetic (built-in, default), instruct, glue8, or a GLUE task (sst2, cola, ...)")
    data: str | None = _opt(None, "GLUE folder or LLM-Adapters JSON file (default: built-in task / Hub)")
    method: str = _opt("prism", "a method registered in prismdp.engine.METHODS: prism (default), dp-adamw, ffa, "
                                "lora-plus, lamb, lora-rite, ...")
    method_kwargs: dict[str, Any] = _opt(None, "the method's own options as a YAML mapping, e.g. '{preset: "
                                         "reference}', '{floor_mode: geometry, debias: false}' (PRISM) or "
                                         "'{loraplus_ratio: 6}' (LoRA+)", factory=dict)
    dp: bool = _opt(True, "non-private run with the same method", flag="--no-dp")
    epsilon: float = _opt(3.0, "target epsilon (default 3)")
    sigma: float | None = _opt(None, "noise multiplier, instead of calibrating it to --epsilon (the run then reports "
                                     "the epsilon it spent; prismdp tune sets it per trial)")
    delta: float = _opt(1e-5, "delta (default 1e-5); must lie below 1/N (N = training examples, or users)")
    allow_large_delta: bool = _opt(False, "accept a delta at or above 1/N (a weak guarantee: publishing one random "
                                          "example in the clear is (0, 1/N)-DP)")
    accountant: str = _opt("prv", "privacy accountant: Opacus' prv (default) or rdp, or dp-accounting's pld",
                           choices=("prv", "rdp", "pld"))
    steps: int | None = _opt(None, "logical steps (default per task family: 500 GLUE, 300 Math, 100 demo)")
    batch_size: float | None = _opt(None, "expected logical batch size (Poisson rate q = batch_size / dataset size)")
    micro_batch_size: int = _opt(8, "examples per forward/backward pass (default 8)")
    group_by_length: bool = _opt(True, "do not order each logical batch by length before splitting it into "
                                       "micro-batches (ordering saves padding and changes nothing in the mechanism)",
                                 flag="--no-group-by-length")
    lr: float | None = _opt(None, "learning rate (default: the method's rate for the task family)")
    head_lr: float | None = _opt(None, "learning rate of the trainable non-LoRA parameters (an encoder's new head; "
                                       "default --lr)")
    device: str = _opt("auto", "auto (default: cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    dtype: str = _opt("float32", "dtype of the frozen base model; the LoRA factors, a new head, per-example "
                                 "gradients, clipping, noise and the optimizer stay float32",
                      choices=("float32", "bfloat16", "float16"))
    quantize: str | None = _opt(None, "hold the frozen base in bitsandbytes' 4 bits (NF4, QLoRA) or 8 bits (LLM.int8), "
                                      "computing in --dtype; the LoRA factors and the whole mechanism stay float32 "
                                      "(needs bitsandbytes; with --fsdp, 4 bits are torchao's NF4, which FSDP shards: "
                                      "needs torchao)", choices=("4bit", "8bit"))
    gradient_checkpointing: bool = _opt(False, "recompute each transformer block in the backward pass (less memory, "
                                               "about one more forward of compute; per-example gradients exact)")
    fsdp: bool = _opt(False, "under torchrun: shard the frozen base model across the processes with FSDP2 (each "
                             "holds 1/N of its weights; the LoRA factors stay whole on every process)")
    pooling: str = _opt("model", "encoder tasks: the checkpoint's own head (model, default) or a new head on the "
                                 "masked mean of the last hidden states (mean: what sentence encoders such as "
                                 "all-MiniLM-L6-v2 were trained for)", choices=("model", "mean"))
    rank: int | None = _opt(None, "LoRA rank r (default per task family: 16 GLUE/Math, 4 demo)")
    alpha: float | None = _opt(None, "LoRA alpha (default 16)")
    dropout: float = _opt(0.05, "LoRA dropout (default 0.05)")
    target_modules: list[str] | None = _opt(None, "comma-separated module names (default: q/k/v(/up/down) for the "
                                                  "model family)")
    max_grad_norm: float = _opt(1.0, "clipping bound C (default 1)")
    privacy_unit: str = _opt("example", "what the guarantee protects: one example, or one user with all of their "
                                        "examples (sampled, averaged and clipped as one; needs --user-id-column)",
                             choices=("example", "user"))
    user_id_column: str | None = _opt(None, "the record key naming each example's user (privacy_unit user)")
    seed: int = _opt(42, "seed of the run (sampling, noise, start; default 42)")
    secure_noise: bool = _opt(False, "noise and Poisson sampling from an OS-keyed ChaCha20 generator, the noise as "
                                     "Holohan-Braghin sums of normals (not reproducible; --seed then seeds only the "
                                     "initialisation, dropout and data subsets)")
    noise_threads: int | None = _opt(None, "--secure-noise: CPU threads drawing the noise (default: torch's "
                                           "intra-op threads; torchrun sets 1 per process, so under torchrun give "
                                           "each process its share of the host's cores, e.g. cores / processes)")
    products: str = _opt("float32", "precision of the per-example gradient products: float32 (default), or tf32 / "
                                    "bf16 inputs with float32 accumulation (faster on a GPU; error against float64 "
                                    "in docs/gpu-readiness.md; the guarantee is unchanged)",
                         choices=("float32", "tf32", "bf16"))
    threads: int | None = _opt(None, "CPU threads of torch's operators during the run (torch.set_num_threads; "
                                     "default torch's own: OMP_NUM_THREADS, else every core; torchrun sets 1 per "
                                     "process). On a CPU shared with another busy job give each its share, e.g. "
                                     "--threads 1 beside one other job on 2 cores")
    max_length: int = _opt(128, "tokens per example (default 128)")
    train_on_inputs: bool = _opt(False, "causal LM tasks: train on the prompt tokens too")
    init: str = _opt("spectral", "the rank-r start: top-r SVD part of the base weight, or a small random one",
                     choices=("spectral", "random"))
    start: str = _opt("method", "where the LoRA factors start: the method's own point (PRISM: the rank-r start; the "
                                "factor-space methods: PEFT's init, B = 0) or the rank-r start for every method "
                                "(separates PRISM's start from its geometry)", choices=("method", "rank-r"))
    train_examples: int | None = _opt(None, "seeded subset of the training set")
    holdout_val: int | None = _opt(None, "GLUE: carve this many training examples out as eval set 'val' (for "
                                         "tuning; the same examples for every seed)")
    holdout_test: int | None = _opt(None, "GLUE: carve this many out as eval set 'test', replacing the official "
                                          "dev set (for tasks without a labelled dev set here, e.g. QQP)")
    eval_splits: list[str] | None = _opt(None, "GLUE validation splits to evaluate (default all; MNLI: "
                                               "validation_matched,validation_mismatched)")
    eval_examples: int | None = _opt(None, "evaluate on the first this-many examples of each eval set")
    synthetic_train: int = _opt(8000, "built-in task: training examples")
    synthetic_test: int = _opt(500, "built-in task: test examples")
    eval_batch_size: int = _opt(64, "evaluation batch size")
    checkpoint_every: int = _opt(50, "steps between checkpoints")
    output: str = _opt("runs/prismdp", "run folder (default runs/prismdp)")
    # generation-based evaluation of causal-LM tasks (instruct, glue8); see prismdp.eval.generation
    eval_tasks: list[str] | None = _opt(None, "causal-LM tasks: generation eval sets, e.g. math (gsm8k,aqua,mawps,"
                                              "svamp) or glue8 / cola,... (default: glue8's eight for glue8)")
    eval_data: str | None = _opt(None, "folder of the eval sets (default: next to --data)")
    max_new_tokens: int | None = _opt(None, "generation length (default 8 GLUE, 256 math)")
    aqua_rule: str = _opt("first", "AQuA letter rule (default first = upstream LLM-Adapters)",
                          choices=("first", "last", "prism"))
    glue8_per_task: int = _opt(1250, "task glue8: training examples per GLUE task (the paper's 1,250)")

    def __post_init__(self):
        def bad(key, msg):
            raise ConfigError(f"{key}: {msg}")

        for f in dataclasses.fields(self):  # strict booleans: the string "no" (quoted in YAML) is not False
            if str(f.type) == "bool" and not isinstance(getattr(self, f.name), bool):
                bad(f.name, f"must be true or false (unquoted in YAML), got {getattr(self, f.name)!r}")
            v = getattr(self, f.name)  # numbers: finite (YAML's .nan and .inf), integers within int64
            if isinstance(v, float) and not math.isfinite(v) or isinstance(v, int) and abs(v) >= 2**63:
                bad(f.name, f"must be a finite number of reasonable size, got {v!r}")

        from ..data.tasks import TASKS, expand_eval_tasks  # the task registry (imports torch: not at parse time)
        from ..eval.answers import AQUA_RULES

        if self.task not in TASKS:
            bad("task", f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        task = TASKS[self.task]
        causal = [t.name for t in TASKS.values() if t.head == "causal_lm"]
        for key, value in FAMILY_DEFAULTS[self.task_family].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key in ("steps", "micro_batch_size", "rank", "max_length", "eval_batch_size", "synthetic_train",
                    "synthetic_test", "checkpoint_every"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(key, f"must be a positive integer, got {v!r}")
        for key in ("batch_size", "alpha", "max_grad_norm", "epsilon"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                bad(key, f"must be a positive number, got {v!r}")
        if self.lr is not None and not self.lr > 0:
            bad("lr", f"must be a positive number, got {self.lr!r}")
        if self.sigma is not None and (isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float))
                                       or not self.sigma > 0 or not self.dp):
            bad("sigma", f"must be a positive number in a private run (no --no-dp), got {self.sigma!r}")
        if self.head_lr is not None and not self.head_lr > 0:
            bad("head_lr", f"must be a positive number, got {self.head_lr!r}")
        if not 0 < self.delta < 1:
            bad("delta", f"must lie in (0, 1), got {self.delta!r}")
        if not 0 <= self.dropout < 1:
            bad("dropout", f"must lie in [0, 1), got {self.dropout!r}")
        if self.accountant not in ("prv", "rdp", "pld"):
            bad("accountant", f"must be 'prv', 'rdp' or 'pld', got {self.accountant!r}")
        if not isinstance(self.device, str):
            bad("device", f"must be a string such as auto, cpu, cuda or cuda:1, got {self.device!r}")
        if self.device != "auto":
            import torch

            try:
                dev = torch.device(self.device)
            except (RuntimeError, ValueError):
                bad("device", f"{self.device!r} is not a torch device; use auto, cpu, cuda, cuda:N or mps")
            if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
                bad("device", f"{self.device!r} is not available here (torch.cuda.is_available() = "
                              f"{torch.cuda.is_available()}, {torch.cuda.device_count()} device(s)); use device: auto "
                              f"or cpu, or install a CUDA build of torch")
            if dev.type == "mps" and not torch.backends.mps.is_available():
                bad("device", "mps is not available here; use device: auto or cpu")
        if self.quantize not in (None, "4bit", "8bit"):
            bad("quantize", f"must be 4bit, 8bit or null (an unquantized base), got {self.quantize!r}")
        if self.pooling not in ("model", "mean"):
            bad("pooling", f"must be 'model' (the checkpoint's own classification head) or 'mean' (a new head on "
                           f"the masked mean of the last hidden states), got {self.pooling!r}")
        if self.pooling == "mean" and task.head == "causal_lm":
            bad("pooling", f"'mean' builds a classification head; task {self.task!r} trains a causal LM "
                           f"(use pooling: model)")
        if self.init not in ("spectral", "random"):
            bad("init", f"must be 'spectral' or 'random', got {self.init!r}")
        if self.start not in ("method", "rank-r"):
            bad("start", f"must be 'method' or 'rank-r', got {self.start!r}")
        if self.noise_threads is not None and not self.secure_noise:
            bad("noise_threads", "sets the threads of --secure-noise's ChaCha20 noise; add --secure-noise or leave "
                                 "it out")
        for key in ("train_examples", "eval_examples", "max_new_tokens", "holdout_val", "holdout_test",
                    "noise_threads", "threads"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(key, f"must be a positive integer or null, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            bad("seed", f"must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.glue8_per_task, bool) or not isinstance(self.glue8_per_task, int) or self.glue8_per_task < 1:
            bad("glue8_per_task", f"must be a positive integer, got {self.glue8_per_task!r}")
        if self.aqua_rule not in AQUA_RULES:
            bad("aqua_rule", f"must be one of {', '.join(AQUA_RULES)}, got {self.aqua_rule!r}")
        if self.eval_tasks is not None:
            if task.head != "causal_lm":
                bad("eval_tasks", f"applies to the causal-LM tasks {', '.join(causal)} (generation-based "
                                  f"evaluation), not to task {self.task!r}")
            try:
                self.eval_tasks = expand_eval_tasks(self.eval_tasks)
            except ValueError as e:
                bad("eval_tasks", str(e))
        if self.privacy_unit not in ("example", "user"):
            bad("privacy_unit", f"must be 'example' or 'user', got {self.privacy_unit!r}")
        if (self.privacy_unit == "user") != (self.user_id_column is not None):
            bad("user_id_column", "privacy_unit user needs --user-id-column COL (the key that names each example's "
                                  "user), and --user-id-column applies to privacy_unit user only")
        if isinstance(self.eval_splits, str):
            self.eval_splits = [t.strip() for t in self.eval_splits.split(",") if t.strip()]
        if (self.holdout_val or self.holdout_test or self.eval_splits) and task.glue is None:
            bad("holdout_val", f"holdout_val, holdout_test and eval_splits apply to GLUE tasks, not {self.task!r}")
        if isinstance(self.target_modules, str):
            self.target_modules = [t.strip() for t in self.target_modules.split(",") if t.strip()]
        if self.target_modules is not None and not self.target_modules:
            bad("target_modules", "is empty; give module names such as query,value")
        self.batch_size = float(self.batch_size)

    @property
    def task_family(self) -> str:
        """The task's family (:data:`prismdp.data.tasks.TASKS`): 'math' for instruction tuning (the paper's Math-10K
        rates), 'demo' for the built-in task, 'glue' otherwise (glue8 trains at the GLUE rates)."""
        from ..data.tasks import TASKS

        return TASKS[self.task].family

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def torch_device(self, world=None):
        """The device the run trains on (``auto``: the first CUDA device if there is one, else the CPU; in a
        multi-process run on GPUs, each process's own ``cuda:LOCAL_RANK``)."""
        import torch

        if world is not None and world.backend == "nccl":
            return world.device
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        values = dict(values)
        for k, v in values.items():  # YAML 1.1 reads 5e-3 (no dot) as a string
            if isinstance(v, str) and types[k].startswith(("float", "int | float", "float | None")):
                try:
                    values[k] = float(v)
                except ValueError:
                    raise ConfigError(f"{source}: {k} must be a number, got {v!r}") from None
        return cls(**values)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of TrainConfig keys (dashes or underscores)."""
    from ..data.files import read_text

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = read_text(p, "a config file", ConfigError)
    if p.suffix.lower() == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values, got {type(data).__name__}")
    return {k.replace("-", "_"): v for k, v in data.items()}
