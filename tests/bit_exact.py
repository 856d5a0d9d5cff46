"""The bit-exact record: what the engine emits, bit for bit, in every cell of the FlashLoop
feature matrix (CPU, fp32, the torch backend) and in the adaptive-exit mode, with the
bytes of snapshots taken mid-run and what a fresh engine emits after restoring one.

Refactors that must not change arithmetic (issue 36: FlashLoop as plug-in features) are
checked against `tests/golden/bit_exact.json` by `tests/test_bit_exact.py`; snapshot files
the recording tree wrote lie in `tests/golden/snapshots/` and must restore in the tree
under test. A change that alters numerics on purpose records again and says why in its
commit:

    python -m tests.bit_exact            # rewrites tests/golden/

Each cell runs the matrix's two prompts (90 and 37 tokens, 6 tokens each); before steps
SNAP_STEPS it snapshots every live request (the sha256 of its content, `content_bytes`:
every value and tensor in key order, with the checkpoint's folder, which differs per run,
blanked in the diagnostic summary); the first snapshot of the run whose request is running
is restored into a fresh engine, which drains. The files of KEPT cells hold that snapshot
as the recording tree wrote it (tensors cloned: torch.save writes a view's whole storage).

Bits depend on the CPU's vector unit; the record names the capability it was taken with,
and on another one `tests/test_bit_exact.py` compares tokens exactly and logprobs to 1e-6.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import RequestSnapshot
from tests import test_flashloop_matrix as matrix
from tests.conftest import TINY, make_checkpoint

GOLDEN = Path(__file__).resolve().parent / "golden"
RECORD = GOLDEN / "bit_exact.json"
SNAPSHOTS = GOLDEN / "snapshots"
SNAP_STEPS = (2, 5)
CHECKPOINT_SEED = 1  # the `tiny_ckpt` fixture's
EXIT_MODE = {"exit_threshold": 0.5}
KEPT = ("prefill+decode+int4-plain-greedy", "prefill+decode+int4-block-greedy", "prefill+decode+int4-pipeline-greedy",
        "prefill+decode+int4-exit-greedy", "dense-plain-seeded", "dense-block-seeded", "dense-pipeline-seeded")


def cpu_key() -> str:
    """The vector unit the bits depend on: torch's capability (tests/conftest.py pins AVX2)
    and, on a CPU with AVX-512 beyond it, that too: the matmul libraries choose kernels by
    the CPU itself, so a pinned AVX2 on an AVX-512 machine still rounds otherwise (seen:
    the last bit of most logprobs)."""
    key = torch.backends.cpu.get_cpu_capability()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    if "avx512f" in flags and "AVX512" not in key:
        key += "+avx512f"
    return key


def cells() -> list[tuple[str, tuple[bool, bool, bool], str, str]]:
    """(name, combo, mode, sampling): the 48 matrix cells, then adaptive exit with every
    feature off and with all three on."""
    out = [(f"{matrix._name(c)}-{m}-{s}", c, m, s) for c in matrix.COMBOS for m in matrix.SPEC for s in matrix.SAMPLING]
    out += [(f"{matrix._name(c)}-exit-{s}", c, "exit", s) for c in ((False,) * 3, (True,) * 3) for s in matrix.SAMPLING]
    return out


def engine(ckpt: Path, combo: tuple[bool, bool, bool], mode: str) -> EngineCore:
    """Prefix caching off as when the record was taken (the snapshots carry the options; the
    cells share no prefix, so caching would not change their arithmetic)."""
    if mode == "exit":
        return EngineCore(EngineConfig.from_kwargs(str(ckpt), dtype="float32", num_kv_pages=512, block_size=4,
                                                   device="cpu", attention_backend="torch", enable_prefix_caching=False,
                                                   **matrix._options(combo), **EXIT_MODE))
    return matrix._engine(ckpt, combo, mode, device="cpu", attention_backend="torch", enable_prefix_caching=False)


def content_bytes(value: Any) -> bytes:
    """A canonical serialization of a snapshot's data: plain values as JSON, tensors as
    dtype, shape and contiguous bytes, dicts in key order; the checkpoint folder blanked."""
    if isinstance(value, dict):
        if "engine" in value and "format" in value:
            value = dict(value, engine=dict(value["engine"], model="<checkpoint>"))
        return b"{" + b",".join(json.dumps(str(k)).encode() + b":" + content_bytes(value[k]) for k in sorted(value, key=str)) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(content_bytes(v) for v in value) + b"]"
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        head = f"tensor({t.dtype},{tuple(t.shape)}):".encode()
        return head + (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return json.dumps(value).encode()


def content_hash(snap: RequestSnapshot) -> str:
    return hashlib.sha256(content_bytes(snap.data)).hexdigest()


def compact(snap: RequestSnapshot) -> bytes:
    """The snapshot's bytes with each tensor cloned (same content; a view's storage dropped)
    and the checkpoint folder blanked in the diagnostic summary."""
    def clone(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: clone(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clone(x) for x in v]
        return v
    data = clone(snap.data)
    data["engine"]["model"] = "<checkpoint>"
    return RequestSnapshot(data).to_bytes()


def _emitted(out: dict[str, Any], outputs) -> None:
    for o in outputs:
        assert o.error is None, o.error
        got = out.setdefault(o.request_id, {"tokens": [], "logprobs": []})
        got["tokens"] += o.token_ids
        got["logprobs"] += [float(lp).hex() for lp in o.logprobs or []]


def run_cell(ckpt: Path, combo: tuple[bool, bool, bool], mode: str, sampling: str) -> tuple[dict[str, Any], bytes]:
    """The cell's record and the bytes of the snapshot its restore run starts from."""
    eng = engine(ckpt, combo, mode)
    for i, prompt in enumerate(matrix.PROMPTS):
        eng.add_request(f"r{i}", prompt, matrix.SAMPLING[sampling])
    out: dict[str, Any] = {}
    hashes, first = [], None
    step = 0
    while eng.has_unfinished():
        if step in SNAP_STEPS:
            for rid in sorted(eng.requests):
                raw = eng.snapshot(rid).to_bytes()
                snap = RequestSnapshot.from_bytes(raw)
                hashes.append({"step": step, "request": rid, "sha256": content_hash(snap)})
                if first is None and snap.data["kv"] is not None:
                    first = raw
        _emitted(out, eng.step())
        step += 1
    assert first is not None, "no request was running at a snapshot step"
    return {"emitted": out, "snapshots": hashes, "restored": restore_run(ckpt, combo, mode, first)}, first


def restore_run(ckpt: Path, combo: tuple[bool, bool, bool], mode: str, raw: bytes) -> dict[str, Any]:
    """What a fresh engine emits after restoring the snapshot `raw`."""
    eng = engine(ckpt, combo, mode)
    eng.restore(RequestSnapshot.from_bytes(raw))
    out: dict[str, Any] = {}
    while eng.has_unfinished():
        _emitted(out, eng.step())
    return out


def record() -> None:
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SNAPSHOTS.glob("*.snap"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp), TINY, seed=CHECKPOINT_SEED)
        result: dict[str, Any] = {"cpu_capability": cpu_key(), "cells": {}}
        for name, combo, mode, sampling in cells():
            result["cells"][name], raw = run_cell(ckpt, combo, mode, sampling)
            if name in KEPT:
                (SNAPSHOTS / f"{name}.snap").write_bytes(compact(RequestSnapshot.from_bytes(raw)))
            print(name, file=sys.stderr)
    RECORD.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    record()
