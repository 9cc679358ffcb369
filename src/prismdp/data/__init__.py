"""Data building blocks: the task registry (:mod:`.tasks`), GLUE readers, LLM-Adapters instruction data, the synthetic
demo task, tokenisation for classification, and batch collation.  Each submodule has one job; the common names are
re-exported here."""

from .classification import EncodedClassification, encode_classification
from .collate import pad_collate
from .example import Example
from .glue import GlueDataError, load_glue
from .instruct import (
    IGNORE_INDEX,
    InstructDataError,
    InstructDataset,
    build_instruct_dataset,
    generate_prompt,
    load_instruct_json,
    tokenize_instruct,
)
from .synthetic import make_synthetic_task
from .tasks import GLUE_TASKS, TASKS, GlueTask, glue_task

__all__ = [
    "Example",
    "TASKS",
    "GLUE_TASKS",
    "GlueDataError",
    "GlueTask",
    "glue_task",
    "load_glue",
    "IGNORE_INDEX",
    "InstructDataError",
    "InstructDataset",
    "load_instruct_json",
    "generate_prompt",
    "tokenize_instruct",
    "build_instruct_dataset",
    "EncodedClassification",
    "encode_classification",
    "make_synthetic_task",
    "pad_collate",
]
