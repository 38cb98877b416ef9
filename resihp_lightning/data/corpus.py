"""Text corpora: JSONL, a folder of text files, one text file, or the Python standard library.

Every source yields documents (strings) in a deterministic order. The default corpus, when the user
names none, is the standard library's own ``.py`` files on this machine
(``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded): real code with a long-tailed
length distribution, like the GitHub code the ResiHP paper trains on.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from resihp_lightning.errors import ConfigError

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_JSONL_SUFFIXES = {".jsonl", ".ndjson"}


def _walk_files(root: Path, suffix: str | None = None) -> list[Path]:
    """Files under ``root`` sorted by relative path, pruning hidden and package-install dirs."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(dirpath, name)
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return [p for _, p in sorted(found)]


def stdlib_source_files(max_files: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path.

    Args:
        max_files: keep only the first this many (in sorted order); ``None`` keeps all.

    Returns:
        Paths of the files.
    """
    files = _walk_files(Path(sysconfig.get_paths()["stdlib"]), suffix=".py")
    return files if max_files is None else files[:max_files]


def _read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\x00" in data[:4096]:
        return None  # binary file
    return data.decode("utf-8", errors="replace")


def iter_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSONL file.

    Raises:
        ConfigError: naming the file and line, for a line that is not a JSON object.
    """
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for lineno, record in iter_records(path):
        if not isinstance(record.get(field), str):
            raise ConfigError(f"{path}:{lineno}: expected an object with a string field {field!r}")
        yield record[field]


def iter_documents(
    source: str | Path | None = None,
    max_files: int | None = None,
    text_field: str = "text",
    shuffle_seed: int | None = None,
) -> Iterator[str]:
    """Yields the documents of a corpus, in a deterministic order.

    Args:
        source: ``None`` (the standard library's ``.py`` files), a ``.jsonl`` file (one
            ``{"text": ...}`` object per line), a directory (every non-hidden text file under it,
            sorted by relative path; binary files are skipped) or a single text file.
        max_files: cap on the number of files read from a directory or the standard library.
        text_field: the JSONL field that holds the text.
        shuffle_seed: if set, files (not JSONL lines) are read in a permutation of the sorted order
            drawn with this seed, before ``max_files`` applies — a capped corpus then mixes the
            whole tree instead of its alphabetically first directories. Still deterministic.

    Raises:
        ConfigError: the source does not exist, or a JSONL line is malformed.
    """
    if source is None:
        files = stdlib_source_files()
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"data source {str(path)!r} does not exist")
        if path.is_file() and path.suffix.lower() in _JSONL_SUFFIXES:
            yield from _jsonl_documents(path, text_field)
            return
        if path.is_file():
            files = [path]
        else:
            files = _walk_files(path)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(files)
    if max_files is not None:
        files = files[:max_files]
    for file in files:
        text = _read_text(file)
        if text is not None:
            yield text
