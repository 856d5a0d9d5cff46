"""Step 1 of building the default model (CPU, seconds): tokenizer and tokenised corpus.

    python -m specloop.training.prepare --tokenizer-out specloop/assets/default_model \
        --streams out/stdlib_tokens.npz

trains the byte-level BPE on the running Python's stdlib train split, writes it into the
checkpoint folder, and tokenises all three splits into one `.npz` that the trainer reads
(on this machine or carried to the GPU machine). With `--tokenizer DIR` it reuses an
existing tokenizer and only tokenises.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specloop.training.corpus import load_split, python_version, stdlib_root
from specloop.training.recipe import DEFAULT_MODEL
from specloop.training.token_data import build_streams, save_streams
from specloop.training.tokenizer_training import DEFAULT_VOCAB_SIZE, train_bpe, write_tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specloop.training.prepare", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer-out", type=Path, help="train a BPE and write it to this folder")
    src.add_argument("--tokenizer", type=Path, help="reuse the tokenizer.json in this folder")
    p.add_argument("--streams", type=Path, required=True, help="output .npz of tokenised splits")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--stdlib", type=Path, default=None, help="stdlib root (default: the running Python's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tokenizers import Tokenizer

    root = args.stdlib or stdlib_root()
    start = time.perf_counter()
    if args.tokenizer_out is not None:
        train_files = load_split("train", root)
        tok = train_bpe((f.text for f in train_files), vocab_size=args.vocab_size)
        write_tokenizer(tok, args.tokenizer_out, max_length=DEFAULT_MODEL.max_position_embeddings)
        print(f"tokenizer: {tok.get_vocab_size()} entries from {len(train_files)} train files of Python "
              f"{python_version()} -> {args.tokenizer_out}", file=sys.stderr)
    else:
        tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    streams, manifest = build_streams(tok, root)
    manifest["vocab_size"] = tok.get_vocab_size()
    save_streams(args.streams, streams, manifest)
    print(json.dumps(manifest["splits"]), f"in {time.perf_counter() - start:.1f}s -> {args.streams}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
