"""Checkpoint folders: loading, validation, tokenizers and random checkpoints."""

from specloop.checkpoint.loader import LoadReport, expected_shapes, load_config, load_model, resolve_dtype
from specloop.checkpoint.tokenizer import load_tokenizer, stop_token_ids

__all__ = ["LoadReport", "expected_shapes", "load_config", "load_model", "load_tokenizer",
           "resolve_dtype", "stop_token_ids"]
