"""Tokenizers for the packed dataset: the checkpoint's own, or a byte-level fallback.

Both expose the small interface the dataset needs (:class:`Tokenizer`): ``encode(text)`` without
special tokens, ``decode(ids)``, ``eos_token_id``, ``pad_token_id`` and ``vocab_size``.

The byte-level fallback (:class:`ByteTokenizer`) has a fixed vocabulary of 259 ids: ids 0–255 are
the UTF-8 bytes, 256 is ``<pad>``, 257 is ``<bos>``, 258 is ``<eos>``. A model trained with it needs
``vocab_size >= 259`` (:func:`resihp_lightning.models.hf_checkpoint.tiny_config` uses 260).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from resihp_lightning.errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@runtime_checkable
class Tokenizer(Protocol):
    """What the packed dataset needs from a tokenizer."""

    eos_token_id: int
    pad_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus ``<pad>`` (256), ``<bos>`` (257) and ``<eos>`` (258)."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` (no special tokens)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Decodes byte ids; special ids are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter around a Hugging Face tokenizer loaded from a local directory.

    Args:
        tokenizer: the ``transformers`` tokenizer.

    Raises:
        ConfigError: the tokenizer has no end-of-sequence token.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ConfigError("the checkpoint's tokenizer has no eos_token; packed documents need one")
        self.eos_token_id = int(eos)
        pad = getattr(tokenizer, "pad_token_id", None)
        # Padding positions carry label -100 and are masked from attention, so any id works.
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(list(ids))

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Writes the tokenizer files next to a saved checkpoint."""
        self.tokenizer.save_pretrained(str(out_dir))


def has_hf_tokenizer(model_dir: str | Path | None) -> bool:
    """True when ``model_dir`` holds tokenizer files."""
    if model_dir is None:
        return False
    directory = Path(model_dir)
    return directory.is_dir() and any((directory / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The checkpoint's tokenizer when ``model_dir`` has one (local files only), else bytes.

    Args:
        model_dir: a Hugging Face checkpoint directory, or ``None``.

    Returns:
        :class:`HFTokenizer` or :class:`ByteTokenizer`.
    """
    if not has_hf_tokenizer(model_dir):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))
