"""Reading a text file the user named: a folder in a file's place, a missing file or bytes that are not UTF-8 give an
error naming the file (and for bad bytes the line) and the fix, never a bare ``IsADirectoryError`` or codec error."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

__all__ = ["read_text"]


def read_text(path: Union[str, os.PathLike], what: str, error: type[Exception] = ValueError,
              encoding: str = "utf-8") -> str:
    """The text of ``path`` (``what`` names the file's role in messages, e.g. "the SST-2 training TSV"); ``error``
    is the exception class for unusable content (a folder, bytes that are not ``encoding``)."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{p} is a folder, but {what} must be a file: move the folder away or point to the file")
    if not p.exists():
        raise FileNotFoundError(f"{what} {p} does not exist")
    raw = p.read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(
            f"{p}:{line}: byte 0x{raw[e.start]:02x} at column {column} is not UTF-8, but {what} must be UTF-8 text. "
            f"Convert the file, e.g. from Latin-1: iconv -f latin1 -t utf-8 {p.name} > {p.stem}-utf8{p.suffix}"
        ) from None
