"""Packed variable-length causal-LM datasets.

* :mod:`.corpus` — documents from JSONL, a folder, a file, or the standard library's ``.py`` files;
* :mod:`.tokenizer` — the checkpoint's tokenizer or a byte-level fallback;
* :mod:`.packed` — rows of ``seq_len`` tokens with ``input_ids``, ``position_ids``, ``labels`` and
  per-segment ``seq_lens``; a collate function and the split the strategy's ``pipeline_batch`` uses.
"""

from resihp_lightning.data.corpus import iter_documents, stdlib_source_files
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
    "IGNORE_INDEX",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "batch_workload",
    "build_packed_dataset",
    "collate_packed",
    "has_hf_tokenizer",
    "iter_documents",
    "load_tokenizer",
    "stdlib_source_files",
    "to_pipeline_batch",
    "tokenize_documents",
]
