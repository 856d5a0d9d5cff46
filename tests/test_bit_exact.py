"""The engine reproduces `tests/golden/bit_exact.json` bit for bit: token ids, logprob bits,
snapshot contents and restored runs of every FlashLoop matrix cell and the adaptive-exit
mode (CPU, fp32, the torch backend; `tests/bit_exact.py` says what a cell runs and how to
record again); and the snapshots the recording tree wrote restore here and resume exactly.

Bits are those of the CPU capability the record names (`bit_exact.cpu_key`): on a machine
with another vector unit, tokens must still agree exactly and logprobs to 1e-6 + 1e-6 x
|logprob| (a few fp32 steps: an AVX-512 machine differs from the AVX2 record by up to
1.9e-6 at logprobs near -4), and snapshot contents (their floats) are not compared.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import bit_exact

RECORD = json.loads(bit_exact.RECORD.read_text())
SAME_CPU = RECORD["cpu_capability"] == bit_exact.cpu_key()
CELLS = {name: (combo, mode, sampling) for name, combo, mode, sampling in bit_exact.cells()}


def _assert_emitted(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        if SAME_CPU:
            assert got[rid]["logprobs"] == want[rid]["logprobs"], rid
        else:
            as_float = [float.fromhex(x) for x in got[rid]["logprobs"]]
            torch.testing.assert_close(torch.tensor(as_float, dtype=torch.float64),
                                       torch.tensor([float.fromhex(x) for x in want[rid]["logprobs"]],
                                                    dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_the_record_covers_every_cell():
    assert sorted(RECORD["cells"]) == sorted(CELLS)
    assert len(CELLS) == 48 + 4


@pytest.mark.parametrize("name", list(CELLS))
def test_cell_reproduces_the_record(tiny_ckpt, name):
    combo, mode, sampling = CELLS[name]
    want = RECORD["cells"][name]
    got, _ = bit_exact.run_cell(tiny_ckpt, combo, mode, sampling)
    _assert_emitted(got["emitted"], want["emitted"])
    _assert_emitted(got["restored"], want["restored"])
    assert [(s["step"], s["request"]) for s in got["snapshots"]] == [(s["step"], s["request"]) for s in want["snapshots"]]
    if SAME_CPU:
        assert got["snapshots"] == want["snapshots"], "snapshot contents changed"


@pytest.mark.parametrize("name", bit_exact.KEPT)
def test_a_snapshot_the_recording_tree_wrote_restores(tiny_ckpt, name):
    combo, mode, _ = CELLS[name]
    raw = (bit_exact.SNAPSHOTS / f"{name}.snap").read_bytes()
    _assert_emitted(bit_exact.restore_run(tiny_ckpt, combo, mode, raw), RECORD["cells"][name]["restored"])
