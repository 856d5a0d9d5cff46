"""Tokenised corpus splits on disk, and the batches the trainer and evaluator draw.

A split is one token stream: each file's ids followed by `<|endoftext|>` (id 0), files in
sorted path order. Streams are stored as uint16 in one `.npz` with a JSON manifest, so
the corpus tokenised on one machine can travel to another (the GPU) unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specloop.training.corpus import SPLITS, SourceFile, load_split, python_version, stdlib_root

ENDOFTEXT_ID = 0


def encode_files(tokenizer: Any, files: Sequence[SourceFile]) -> np.ndarray:
    """One uint16 stream: every file's ids, each followed by <|endoftext|>."""
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError("uint16 streams need a vocabulary of at most 65536 entries")
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    parts = []
    for enc in encodings:
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([ENDOFTEXT_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def build_streams(tokenizer: Any, root: Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tokenise every split of the stdlib at `root`; returns streams and a manifest."""
    root = stdlib_root() if root is None else Path(root)
    streams: dict[str, np.ndarray] = {}
    manifest: dict[str, Any] = {"python": python_version(), "stdlib": str(root), "splits": {}}
    for split in SPLITS:
        files = load_split(split, root)
        streams[split] = encode_files(tokenizer, files)
        manifest["splits"][split] = {
            "files": len(files),
            "bytes": sum(len(f.text.encode("utf-8")) for f in files),
            "tokens": int(streams[split].size),
        }
    return streams, manifest


def save_streams(path: Path, streams: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, manifest=np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8), **streams)


def load_streams(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path) as data:
        manifest = json.loads(bytes(data["manifest"]).decode())
        streams = {split: data[split] for split in SPLITS if split in data}
    return streams, manifest


class WindowSampler:
    """Random windows of `seq_len + 1` tokens from a stream (inputs and shifted targets).

    Driven by its own seeded generator, so the batch sequence depends only on the seed.
    Windows may cross file boundaries; the `<|endoftext|>` between files marks them.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if stream.size < seq_len + 2:
            raise ValueError(f"stream of {stream.size} tokens is too short for windows of {seq_len + 1}")
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs, targets: [B, T] int64 on the CPU."""
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.stream[starts[:, None] + offsets[None, :]]
        return windows[:, :-1], windows[:, 1:]


def fixed_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens from the start of a stream: [N, T] int64.

    The evaluation layout: each window is scored on its own from position 0, so every
    token but each window's first is predicted once. A tail shorter than a window is
    dropped.
    """
    count = stream.size // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"stream of {stream.size} tokens holds no window of {seq_len}")
    return torch.from_numpy(stream[: count * seq_len].astype(np.int64)).view(count, seq_len)
