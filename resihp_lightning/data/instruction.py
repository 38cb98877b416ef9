"""Instruction data: JSONL examples to token ids and a per-token target mask.

Two record shapes, one JSON object per line (field names configurable, :class:`InstructionFields`):

* ``{"prompt": "...", "completion": "..."}`` — the ids are ``encode(prompt) + encode(completion) +
  [EOS]`` (the two texts are joined as they are: put any separator, such as a newline, in the
  prompt); the targets are the completion's tokens and the EOS.
* ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}`` — a
  chat, with at least one ``assistant`` message, never as the first message. With a tokenizer that
  has a chat template (a Hugging Face checkpoint's ``tokenizer_config.json`` / ``chat_template.jinja``)
  the chat is rendered by that template; the targets are the assistant turns, found as

  - the template's ``{% generation %}`` blocks when it has them (``apply_chat_template(...,
    return_assistant_tokens_mask=True)``, fast tokenizers), else
  - by rendering prefixes: the text of turn ``i`` is what rendering ``messages[:i+1]`` adds to
    rendering ``messages[:i]`` with ``add_generation_prompt=True`` (so the assistant header is
    context and the content plus the template's end-of-turn marker are targets). The full rendering
    is cut at those character positions and each piece is tokenised on its own, so a target span is
    exact in tokens. A template that renders earlier turns differently once later ones follow is
    refused with an error.

  No EOS is appended: the template's end-of-turn token ends each turn (as at inference).

  Without a chat template (the byte tokenizer, or a checkpoint without one) the chat is rendered in
  this plain format (:data:`PLAIN_ROLE_HEADER`), every message::

      <|role|>\\n{content}\\n            (system, user, ... : context)
      <|assistant|>\\n{content}<EOS>      (assistant: the content and the EOS id are targets)

A document's first token is never a target (nothing in its row precedes it). Examples longer than a
row (``seq_len``) are truncated (their first ``seq_len`` tokens kept) or dropped, as
``truncation`` says, and counted in :class:`InstructionStats`; an example left without any target
token is dropped and counted too. Packing keeps every example whole in one row
(:class:`~resihp_lightning.data.packed.PackedDataset` with ``split_documents=False``) with the
per-document attention of raw text, and labels ``-100`` on everything that is not a target.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resihp_lightning._logging import get_logger
from resihp_lightning.data.corpus import iter_records
from resihp_lightning.data.tokenizer import Tokenizer
from resihp_lightning.errors import ConfigError, invalid_option

FORMATS = ("auto", "text", "prompt_completion", "chat")
"""``data.format`` values: ``auto`` detects a ``.jsonl`` file's format from its first record."""
INSTRUCTION_FORMATS = ("prompt_completion", "chat")
TRUNCATION = ("truncate", "drop")
"""``data.truncation``: what happens to an example longer than ``seq_len`` tokens."""
ASSISTANT_ROLE = "assistant"
PLAIN_ROLE_HEADER = "<|{role}|>\n"
"""The header of each message in the plain chat format (no chat template)."""
JSONL_SUFFIXES = (".jsonl", ".ndjson")

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_log = get_logger(__name__)


@dataclass(frozen=True)
class InstructionFields:
    """JSONL field names. A chat message's keys are always ``role`` and ``content`` (what chat
    templates read)."""

    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    text: str = "text"


@dataclass
class Example:
    """One tokenised example: ``ids`` and, per token, whether it is a target."""

    ids: list[int]
    targets: list[bool]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.targets):
            raise ValueError("an example needs one target flag per token")

    @property
    def num_targets(self) -> int:
        """Target tokens that can carry a label (the first token cannot)."""
        return sum(self.targets[1:])


@dataclass
class InstructionStats:
    """What reading a source kept, cut and left out."""

    files: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    """format per file"""
    records: int = 0
    examples: int = 0
    """kept"""
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0
    chat_rendering: str | None = None
    """``generation`` / ``prefix`` / ``plain``: how chats were rendered (``None``: no chat)."""

    def summary(self, seq_len: int) -> str:
        """One line for the log."""
        parts = [f"{self.examples} of {self.records} examples kept, {self.tokens} tokens ({self.target_tokens} targets)"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to {seq_len} tokens")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} longer than {seq_len} tokens dropped")
        if self.dropped_no_target:
            parts.append(f"{self.dropped_no_target} without a target token left dropped")
        formats = sorted(set(self.formats.values()))
        if formats:
            parts.append("format " + "/".join(formats))
        if self.chat_rendering:
            parts.append(f"chats rendered by {_RENDERING_NAMES[self.chat_rendering]}")
        return "; ".join(parts)


_RENDERING_NAMES = {
    "generation": "the chat template ({% generation %} spans)",
    "prefix": "the chat template (prefix-diffed turns)",
    "plain": "the plain <|role|> format (no chat template)",
}


# ----------------------------------------------------------------------------------- reading
def check_format(value: Any, option: str = "data.format") -> str:
    """Returns ``value`` if it is one of :data:`FORMATS`, else raises naming ``option``."""
    if value not in FORMATS:
        raise invalid_option(option, value, FORMATS)
    return value


def check_truncation(value: Any, option: str = "data.truncation") -> str:
    """Returns ``value`` if it is one of :data:`TRUNCATION`, else raises naming ``option``."""
    if value not in TRUNCATION:
        raise invalid_option(option, value, TRUNCATION)
    return value


def is_jsonl(path: str | Path) -> bool:
    """True for a ``.jsonl`` / ``.ndjson`` file."""
    return Path(path).is_file() and Path(path).suffix.lower() in JSONL_SUFFIXES


def jsonl_files(source: str | Path, max_files: int | None = None) -> list[Path]:
    """The JSONL file ``source``, or the ``.jsonl`` / ``.ndjson`` files under the folder ``source``
    (sorted by relative path, hidden ones skipped), the first ``max_files`` of them.

    Raises:
        ConfigError: ``source`` is missing, is another kind of file, or a folder without JSONL files.
    """
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data source {str(path)!r} does not exist")
    if path.is_file():
        if not is_jsonl(path):
            raise ConfigError(f"instruction data must be a .jsonl file or a folder of them, not {str(path)!r}")
        return [path]
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in JSONL_SUFFIXES
         and not any(part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ConfigError(f"no .jsonl files under {str(path)!r}")
    return files if max_files is None else files[:max_files]


def record_format(record: Mapping[str, Any], fields: InstructionFields = InstructionFields()) -> str | None:
    """The format a record has (``chat``, ``prompt_completion`` or ``text``), ``None`` when none."""
    if fields.messages in record:
        return "chat"
    if fields.prompt in record and fields.completion in record:
        return "prompt_completion"
    if fields.text in record:
        return "text"
    return None


def detect_format(path: str | Path, fields: InstructionFields = InstructionFields()) -> str:
    """The format of a JSONL file, from its first record.

    Raises:
        ConfigError: the file has no record, or its first record has none of the fields.
    """
    for lineno, record in iter_records(path):
        found = record_format(record, fields)
        if found is None:
            raise ConfigError(
                f"{path}:{lineno}: cannot tell the data format: expected a field {fields.text!r} (text), "
                f"{fields.messages!r} (chat) or {fields.prompt!r} and {fields.completion!r} "
                "(prompt_completion); set data.format and the data.*_field options"
            )
        return found
    raise ConfigError(f"{path}: no records (the file is empty)")


def resolve_format(source: str | Path | None, format: str, fields: InstructionFields = InstructionFields()) -> str:
    """The format to read ``source`` with: ``format`` itself unless it is ``auto``; ``auto`` is the
    first record's format for a JSONL file and ``text`` for anything else (the standard library, a
    folder, a text file)."""
    check_format(format)
    if format != "auto":
        return format
    if source is not None and is_jsonl(source):
        return detect_format(source, fields)
    return "text"


# ---------------------------------------------------------------------------------- encoding
def encode_prompt_completion(prompt: str, completion: str, tokenizer: Tokenizer) -> Example:
    """``encode(prompt) + encode(completion) + [EOS]``; the completion's tokens and the EOS are targets."""
    p = tokenizer.encode(prompt) if prompt else []
    c = tokenizer.encode(completion) if completion else []
    return Example(p + c + [tokenizer.eos_token_id], [False] * len(p) + [True] * (len(c) + 1))


def chat_template_of(tokenizer: Tokenizer) -> str | None:
    """The chat template of an HF tokenizer (:class:`~resihp_lightning.data.tokenizer.HFTokenizer`),
    ``None`` for one without it and for the byte tokenizer."""
    inner = getattr(tokenizer, "tokenizer", None)
    template = getattr(inner, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def chat_rendering(tokenizer: Tokenizer) -> str:
    """How :func:`encode_chat` renders chats with this tokenizer: ``generation``, ``prefix`` or ``plain``."""
    template = chat_template_of(tokenizer)
    if template is None:
        return "plain"
    inner = getattr(tokenizer, "tokenizer", None)
    if _GENERATION_BLOCK.search(template) and getattr(inner, "is_fast", False):
        return "generation"
    return "prefix"


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The messages of a chat record as ``{"role", "content"}`` dicts.

    Raises:
        ConfigError: not a non-empty list of objects with string ``role`` and ``content``, no
            assistant message, or an assistant message first.
    """
    if not isinstance(messages, list) or not messages:
        raise ConfigError("the messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"message {i} is not an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ConfigError(f"message {i} has no string 'role'")
        if not isinstance(content, str):
            raise ConfigError(f"message {i} has no string 'content'")
        out.append({"role": role, "content": content})
    roles = [m["role"] for m in out]
    if ASSISTANT_ROLE not in roles:
        raise ConfigError(f"the chat has no {ASSISTANT_ROLE!r} message (nothing to train on)")
    if roles[0] == ASSISTANT_ROLE:
        raise ConfigError(f"the chat starts with an {ASSISTANT_ROLE!r} message (it needs a prompt before it)")
    return out


def encode_chat(messages: Any, tokenizer: Tokenizer) -> Example:
    """A chat's ids and targets (the assistant turns); see the module docstring.

    Raises:
        ConfigError: bad messages (:func:`check_messages`), a template that fails on them, or one
            whose assistant turns cannot be located.
    """
    msgs = check_messages(messages)
    mode = chat_rendering(tokenizer)
    if mode == "plain":
        return _encode_plain_chat(msgs, tokenizer)
    inner = tokenizer.tokenizer  # type: ignore[attr-defined]
    try:
        if mode == "generation":
            out = inner.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
            if not any(mask):
                raise ConfigError("the chat template's {% generation %} blocks marked no assistant token")
            return Example([int(i) for i in ids], mask)
        return _encode_prefix_chat(msgs, tokenizer)
    except ConfigError:
        raise
    except Exception as err:  # jinja2's TemplateError, raise_exception() in a template, ...
        raise ConfigError(f"the chat template failed on this chat: {type(err).__name__}: {err}") from None


def _encode_plain_chat(msgs: Sequence[Mapping[str, str]], tokenizer: Tokenizer) -> Example:
    ids: list[int] = []
    targets: list[bool] = []

    def add(text: str, target: bool) -> None:
        if text:
            piece = tokenizer.encode(text)
            ids.extend(piece)
            targets.extend([target] * len(piece))

    for m in msgs:
        add(PLAIN_ROLE_HEADER.format(role=m["role"]), False)
        if m["role"] == ASSISTANT_ROLE:
            add(m["content"], True)
            ids.append(tokenizer.eos_token_id)
            targets.append(True)
        else:
            add(m["content"] + "\n", False)
    return Example(ids, targets)


def _encode_prefix_chat(msgs: Sequence[Mapping[str, str]], tokenizer: Tokenizer) -> Example:
    inner = tokenizer.tokenizer  # type: ignore[attr-defined]

    def render(upto: int, generation_prompt: bool = False) -> str:
        return inner.apply_chat_template(list(msgs[:upto]), tokenize=False, add_generation_prompt=generation_prompt)

    full = render(len(msgs))
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(msgs):
        if m["role"] != ASSISTANT_ROLE:
            continue
        upto = render(i + 1)
        before = render(i, generation_prompt=True)
        if not upto.startswith(before):  # a template that ignores add_generation_prompt differently
            before = render(i)
        if not full.startswith(upto) or not upto.startswith(before) or (spans and len(before) < spans[-1][1]):
            raise ConfigError(
                f"the chat template renders message {i} differently once later messages follow, so its "
                "assistant turns cannot be located; give the template {% generation %} blocks"
            )
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    ids: list[int] = []
    targets: list[bool] = []
    pos = 0
    for start, end in [*spans, (len(full), len(full))]:
        for text, target in ((full[pos:start], False), (full[start:end], True)):
            if text:
                piece = tokenizer.encode(text)
                ids.extend(piece)
                targets.extend([target] * len(piece))
        pos = end
    return Example(ids, targets)


def encode_record(record: Mapping[str, Any], format: str, tokenizer: Tokenizer,
                  fields: InstructionFields = InstructionFields()) -> Example:
    """One record of format ``prompt_completion`` or ``chat`` as an :class:`Example`.

    Raises:
        ConfigError: the record lacks the format's fields or they have the wrong types.
    """
    if format == "prompt_completion":
        prompt, completion = record.get(fields.prompt), record.get(fields.completion)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ConfigError(f"expected string fields {fields.prompt!r} and {fields.completion!r} (prompt_completion)")
        return encode_prompt_completion(prompt, completion, tokenizer)
    if format == "chat":
        if fields.messages not in record:
            raise ConfigError(f"expected a field {fields.messages!r} with the chat's messages (chat)")
        return encode_chat(record[fields.messages], tokenizer)
    raise invalid_option("data.format", format, INSTRUCTION_FORMATS)


def fit_example(example: Example, seq_len: int, truncation: str) -> Example | None:
    """``example`` cut to ``seq_len`` tokens (``truncate``) or ``None`` (``drop``) when longer."""
    if len(example.ids) <= seq_len:
        return example
    if check_truncation(truncation) == "drop":
        return None
    return Example(example.ids[:seq_len], example.targets[:seq_len])


def load_examples(
    source: str | Path,
    tokenizer: Tokenizer,
    seq_len: int,
    format: str = "auto",
    fields: InstructionFields = InstructionFields(),
    truncation: str = "truncate",
    max_files: int | None = None,
    max_tokens: int | None = None,
) -> tuple[list[Example], InstructionStats]:
    """Reads and tokenises the instruction examples of a JSONL file or a folder of JSONL files.

    Args:
        source: a ``.jsonl`` / ``.ndjson`` file or a folder (its JSONL files, sorted).
        tokenizer: from :func:`resihp_lightning.data.tokenizer.load_tokenizer`.
        seq_len: tokens per row: longer examples are truncated or dropped.
        format: ``prompt_completion``, ``chat``, or ``auto`` (each file's first record decides).
        fields: the JSONL field names.
        truncation: ``truncate`` or ``drop`` (:data:`TRUNCATION`).
        max_files: cap on the files read from a folder.
        max_tokens: stop once the kept examples hold this many tokens (whole examples).

    Returns:
        The kept examples, in file and line order, and what was kept / cut / dropped.

    Raises:
        ConfigError: a bad option, a missing source, or a bad record (naming file and line).
    """
    check_format(format)
    check_truncation(truncation)
    if format == "text":
        raise invalid_option("data.format", format, INSTRUCTION_FORMATS + ("auto",))
    stats = InstructionStats()
    examples: list[Example] = []
    for path in jsonl_files(source, max_files):
        if max_tokens is not None and stats.tokens >= max_tokens:
            break
        fmt = detect_format(path, fields) if format == "auto" else format
        if fmt not in INSTRUCTION_FORMATS:
            raise ConfigError(
                f"{path}: holds {fmt} records; instruction data needs {fields.prompt!r}/{fields.completion!r} "
                f"or {fields.messages!r} records (set data.format: text for raw text)"
            )
        stats.files.append(str(path))
        stats.formats[str(path)] = fmt
        if fmt == "chat" and stats.chat_rendering is None:
            stats.chat_rendering = chat_rendering(tokenizer)
        for lineno, record in iter_records(path):
            if max_tokens is not None and stats.tokens >= max_tokens:
                break
            stats.records += 1
            try:
                example = encode_record(record, fmt, tokenizer, fields)
            except ConfigError as err:
                raise ConfigError(f"{path}:{lineno}: {err}") from None
            fitted = fit_example(example, seq_len, truncation)
            if fitted is None:
                stats.dropped_too_long += 1
                continue
            if fitted is not example:
                stats.truncated += 1
            if fitted.num_targets == 0:
                stats.dropped_no_target += 1
                continue
            examples.append(fitted)
            stats.examples += 1
            stats.tokens += len(fitted.ids)
            stats.target_tokens += fitted.num_targets
    if stats.truncated or stats.dropped_too_long or stats.dropped_no_target:
        _log.warning("instruction data %s: %s", source, stats.summary(seq_len))
    return examples, stats
