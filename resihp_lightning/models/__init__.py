"""Adapters that turn Hugging Face Llama / Qwen2 checkpoints into pipeline layers."""
