"""Library messages known to be harmless, filtered in one place: a user sees prismdp's lines and progress bars.

Each filter names the logger (or the warning's module), the message, and why it says nothing about the run; a message
is dropped only where logger (module) and message both match, so a new or different message of the same library
still shows.  :func:`install` puts them in place (idempotent); the command line calls it first thing, and so do the
Python API's entry points (:func:`prismdp.engine.make_private`, :class:`prismdp.integrations.hf.PrivateTrainer`, at
their import too: optional backends log while they are imported) and the examples.  ``install(quiet=True)``
(``--quiet``) also hides transformers' weight-loading bar: only the final lines are left.  Imports nothing of prismdp.
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["LOG_FILTERS", "WARNING_FILTERS", "install", "new_head_report"]

# Heads prismdp adds to a checkpoint (a new classifier; PEFT trains them whole): their weights are missing from it
_NEW_HEADS = re.compile(r"(?:^|\.)(?:classifier|score)\.")


def new_head_report(message: str) -> bool:
    """Whether transformers' LOAD REPORT lists nothing but a new classification head (keys under ``classifier`` /
    ``score`` that are MISSING, or MISMATCHed and re-initialised): the head prismdp asked for with ``num_labels``.
    A report with any other key (missing encoder weights, unexpected keys) is kept."""
    if "LOAD REPORT" not in message:
        return False
    rows = [[c.strip() for c in line.split("|")] for line in message.splitlines() if "|" in line]
    rows = [r for r in rows if len(r) >= 2 and r[0] not in ("Key", "") and not set(r[0]) <= set("-+")]
    return bool(rows) and all(_NEW_HEADS.search(key) and status in ("MISSING", "MISMATCH") for key, status, *_ in rows)


# (logger, message: a regex searched in the record's message or a predicate on it, why it is harmless)
LOG_FILTERS = (
    ("torchao", r"^Failed to load .*\.so: ",
     "transformers and PEFT import torchao wherever it is installed; a CPU build cannot load its CUDA kernels, which "
     "prismdp never calls (its NF4 tensor is plain PyTorch)"),
    ("torchao.kernel.intmm", r"^Warning: Detected no triton, on systems without Triton",
     "torchao's Triton (CUDA) matmul kernels, which prismdp never calls; logged at torchao's import"),
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile",
     "torchao registers its enums the way torch 2.13 deprecates, at import; nothing of the run"),
    ("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community",
     "bitsandbytes' CPU backend tries an optional 4-bit kernel from the Hub (package `kernels`, offline here) and "
     "uses its own CPU kernel instead"),
    ("bitsandbytes.autograd._functions", r"^MatMul8bitLt: inputs will be cast from torch\.\w+ to float16",
     "LLM.int8 (--quantize 8bit) quantizes its inputs from float16 by design, once per layer call (3,360 lines in a "
     "two-example evaluation); tests/test_quantized.py checks the 8-bit base against its de-quantized twin"),
    ("transformers.modeling_utils", new_head_report,
     "the LOAD REPORT of a checkpoint whose only missing weights are the new classification head prismdp asked for "
     "(num_labels): it is initialised and trained, as intended"),
)

# (message regex matched at the start of the warning, category, module regex, why it is harmless)
WARNING_FILTERS = (
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils",
     "peft <= 0.21 reads transformers 5's deprecated alias when it wraps a model: a warning for every run"),
    (r"FSDP2-wrapped module \(.*\) returned a view tensor", UserWarning, r"torch\.distributed\.fsdp\.",
     "prismdp never changes a model output in place (its losses read the logits out of place); "
     "tests/test_fsdp.py checks that a sharded run follows the one-process trajectory"),
    (r"Could not find a config file in .* - will assume that the vocabulary was not modified", UserWarning,
     r"peft\.utils\.save_and_load",
     "saving the adapter of a GGUF model (no config.json beside it): prismdp never resizes the embeddings, so the "
     "vocabulary is indeed the base's"),
)


class _Harmless(logging.Filter):
    """Drops a logger's records whose message matches one of its (known harmless) patterns."""

    def __init__(self, tests):
        super().__init__()
        self.tests = tests

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge: let it through
            return True
        return not any(t(message) if callable(t) else re.search(t, message) for t in self.tests)


def install(quiet: bool = False) -> None:
    """Put every filter of :data:`LOG_FILTERS` and :data:`WARNING_FILTERS` in place (again: no duplicates);
    ``quiet``: also hide transformers' progress bars (the weight-loading bar), for ``--quiet``."""
    by_logger: dict[str, list] = {}
    for name, test, _why in LOG_FILTERS:
        by_logger.setdefault(name, []).append(test)
    for name, tests in by_logger.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Harmless) for f in log.filters):
            log.addFilter(_Harmless(tests))
    for message, category, module, _why in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
