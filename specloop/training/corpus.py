"""The training corpus: the `.py` files of the running Python's standard library.

Every machine that runs specloop has this corpus, so the default model can be rebuilt
with no download. Files are identified by their path relative to the stdlib root
(`json/decoder.py`), and the split is a pure function of that path, so the same module
falls in the same split on every machine and Python version:

    bucket = first 8 bytes of sha256(relative posix path), big-endian, mod 1000
    bucket <  50  -> "heldout"  (5%: evaluation only, never trained on)
    bucket <  70  -> "valid"    (2%: the training curve and best-checkpoint choice)
    otherwise     -> "train"    (93%: tokenizer and model training)

Skipped: installed third-party packages (site-packages, dist-packages), byte-code
caches, `pydoc_data` (a generated blob of documentation prose), and files that are not
valid UTF-8 (a handful of deliberately mis-encoded test inputs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPLITS = ("train", "valid", "heldout")
HELDOUT_BUCKETS = 50  # of 1000
VALID_BUCKETS = 20  # of 1000, right after the held-out ones
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root: the identity used by the split
    text: str


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return ".".join(str(part) for part in sys.version_info[:3])


def split_of(relpath: str) -> str:
    """The split of a module, from its relative path alone (stable across machines)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 1000
    if bucket < HELDOUT_BUCKETS:
        return "heldout"
    if bucket < HELDOUT_BUCKETS + VALID_BUCKETS:
        return "valid"
    return "train"


def module_paths(root: Path | None = None) -> list[str]:
    """Every candidate `.py` file under the stdlib root, sorted, as relative posix paths."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if path.is_file():
            paths.append(rel.as_posix())
    return sorted(paths)


def read_source(path: Path) -> str | None:
    """The file's text, or None when it is not valid UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_split(split: str, root: Path | None = None) -> Iterator[SourceFile]:
    """The readable files of one split, in sorted path order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose from {', '.join(SPLITS)}")
    root = stdlib_root() if root is None else Path(root)
    for rel in module_paths(root):
        if split_of(rel) != split:
            continue
        text = read_source(root / rel)
        if text is not None and text.strip():
            yield SourceFile(rel, text)


def load_split(split: str, root: Path | None = None) -> list[SourceFile]:
    return list(iter_split(split, root))
