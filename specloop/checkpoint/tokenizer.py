"""Tokenizers in the Hugging Face layout: ChatML specials, chat template, stop tokens.

Checkpoints carry their tokenizer (tokenizer.json + tokenizer_config.json); specloop
loads it with `transformers.AutoTokenizer` from the folder and never from a hub, always
with `trust_remote_code=False`: a checkpoint's `auto_map` (Python code shipped beside the
weights) is never imported, and transformers never asks on stdin whether to run it.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from specloop.config import ModelConfig
from specloop.errors import CheckpointError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 as in Ouro's tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_tokenizer() -> Any:
    """A BPE with no merges over the 256 byte symbols, after the three ChatML specials.

    Small and deterministic: it round-trips any text, which is all a random checkpoint
    needs. Trained checkpoints ship a real BPE built the same way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(tokenizer_object: Any, folder: Path, max_length: int) -> None:
    """Save a `tokenizers.Tokenizer` as a Hugging Face fast tokenizer with the chat template.

    The files are written directly (tokenizer.json, tokenizer_config.json naming
    PreTrainedTokenizerFast) so every transformers version reads them the same way.
    """
    tokenizer_object.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": IM_START,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": tok, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def load_tokenizer(folder: str | Path) -> Any:
    """The folder's tokenizer through AutoTokenizer, offline, without the checkpoint's code.

    A tokenizer that only its `auto_map` code could build fails as one CheckpointError."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise CheckpointError(f"{folder} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it warns that it does not know model_type "ouro"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        code = _tokenizer_code(folder)
        if code is not None:
            raise CheckpointError(f"the tokenizer in {folder} is built by the checkpoint's own code ({code}, "
                                  "from auto_map), which specloop never runs; name a transformers class "
                                  "in tokenizer_config.json's tokenizer_class") from None
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {first_line}") from None
    finally:
        quiet.setLevel(level)


def _tokenizer_code(folder: Path) -> str | None:
    """The class tokenizer_config.json's auto_map names for AutoTokenizer, if any (read, never imported)."""
    try:
        auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None
    refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    if isinstance(refs, str):
        return refs
    if isinstance(refs, (list, tuple)):
        return next((r for r in refs if isinstance(r, str)), None)
    return None


def stop_token_ids(cfg: ModelConfig, tokenizer: Any | None) -> tuple[int, ...]:
    """eos_token_id(s) from config.json, the tokenizer's eos, and <|im_end|> when present."""
    ids = set(cfg.eos_token_ids)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        im_end = tokenizer.convert_tokens_to_ids(IM_END)
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
            ids.add(im_end)
    return tuple(sorted(i for i in ids if 0 <= i < cfg.vocab_size))


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes any single token decodes to, or None when the text is normalized.

    Without a normalizer every token covers at most this many bytes of the text it was
    encoded from, so a text of n characters has at least n / longest tokens, which lets
    the engine refuse a prompt that cannot fit before spending seconds tokenizing it. A
    normalizer may delete characters, so then no such bound holds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=None) or None
