"""Finding and validating the safetensors files of a Hugging Face checkpoint folder.

Headers are parsed and checked here before any tensor is read, so a truncated or corrupted
file fails with a message naming the file and tensor instead of a library traceback.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from specloop.errors import CheckpointError

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it (single-file or sharded)."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc})") from None
        files = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(f"shard {shard.name} named in {INDEX_FILE} is missing")
        return files
    single = folder / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return {name: single for name in read_header(single)}


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header: {name: {dtype, shape, data_offsets}}."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path.name} is truncated: no safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CheckpointError(f"{path.name} is truncated or corrupted: header length {header_len} "
                                  f"exceeds the file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path.name} is corrupted: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name} is corrupted: its safetensors header is not an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = math.prod(shape) * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name} is corrupted: bad header entry for tensor {name}") from None
        if end > data_size:
            raise CheckpointError(f"{path.name} is truncated: tensor {name} ends at byte {end} "
                                  f"but the data section holds {data_size}")
        if end - start != expected:
            raise CheckpointError(f"{path.name} is corrupted: tensor {name} has {end - start} bytes, "
                                  f"expected {expected} for {dtype}{shape}")
    return header
