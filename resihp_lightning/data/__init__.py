"""Packed variable-length causal-LM datasets.

* :mod:`.corpus` — documents from JSONL, a folder, a file, or the standard library's ``.py`` files;
* :mod:`.tokenizer` — the checkpoint's tokenizer or a byte-level fallback;
* :mod:`.packed` — rows of ``seq_len`` tokens with ``input_ids``, ``position_ids``, ``labels`` and
  per-segment ``seq_lens``; a collate function and the split the strategy's ``pipeline_batch`` uses;
* :mod:`.instruction` — prompt/completion and chat JSONL examples as token ids + target flags (loss on
  completions / assistant turns only; the checkpoint's chat template when it has one);
* :mod:`.datasets` — from the data options to the training and validation datasets.
"""

from resihp_lightning.data.corpus import iter_documents, stdlib_source_files
from resihp_lightning.data.datasets import Datasets, build_datasets
from resihp_lightning.data.instruction import FORMATS, Example, InstructionFields, encode_chat, load_examples
from resihp_lightning.data.packed import (
    IGNORE_INDEX,
    PackedDataset,
    batch_workload,
    build_packed_dataset,
    collate_packed,
    to_pipeline_batch,
    tokenize_documents,
)
from resihp_lightning.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, has_hf_tokenizer, load_tokenizer

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "Datasets",
    "Example",
    "HFTokenizer",
    "InstructionFields",
    "PackedDataset",
    "Tokenizer",
    "batch_workload",
    "build_datasets",
    "build_packed_dataset",
    "collate_packed",
    "encode_chat",
    "has_hf_tokenizer",
    "iter_documents",
    "load_examples",
    "load_tokenizer",
    "stdlib_source_files",
    "to_pipeline_batch",
    "tokenize_documents",
]
