"""The default model's tokenizer: a byte-level BPE trained on the corpus's train split.

Byte-level so that any text round-trips (no unknown token); the ChatML specials come
first so that `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are ids 0, 1, 2 as in Ouro's
tokenizer; it is saved with `specloop.checkpoint.tokenizer.save_tokenizer`, which adds the
chat template, so `load_tokenizer` reads it like any checkpoint's tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from specloop.checkpoint.tokenizer import SPECIAL_TOKENS, save_tokenizer

DEFAULT_VOCAB_SIZE = 4096


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2) -> Any:
    """Train a byte-level BPE (a `tokenizers.Tokenizer`) on `texts`.

    The trainer is deterministic for a given sequence of texts: pass them in a fixed
    order (the corpus yields files sorted by path).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for index, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != index:
            raise RuntimeError(f"special token {special} got id {tok.token_to_id(special)}, expected {index}")
    return tok


def write_tokenizer(tok: Any, folder: Path, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (with the ChatML chat template) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, folder, max_length=max_length)
