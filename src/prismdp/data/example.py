"""The one record type shared by the text-classification readers (GLUE, synthetic demo task)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

__all__ = ["Example"]


class Example(NamedTuple):
    """A labelled sentence or sentence pair.

    ``text_b`` is ``None`` for single-sentence tasks.  ``label`` is an ``int`` class index (in the order of the
    task's label names, which is the order of the Hugging Face ``datasets`` integer labels) or a ``float`` for
    regression tasks (STS-B).
    """

    text_a: str
    text_b: Optional[str]
    label: Union[int, float]
