"""Packed variable-length causal-LM datasets."""
