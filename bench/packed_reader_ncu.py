"""The packed reader at 32 x 8K for Nsight Compute, and its time by depth (planes read).

Usage (device machine):
    python bench/packed_reader_ncu.py                      # CUDA-event times, depth 0 and 3
    ncu --clock-control none -k regex:_attention_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section MemoryWorkloadAnalysis python bench/packed_reader_ncu.py --no-time

One layer's read of 32 cells of 8,192 dense positions, one decode row each, as
bench/packed_reader_sweep.py builds them, with the engine's block_n and splits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packed_reader_sweep as sweep  # noqa: E402

from specloop.kernels.packed_attention import packed_attention_triton, packed_splits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-time", action="store_true", help="one launch each (warm-up, then the profiled one)")
    p.add_argument("--block-n", default="32,64")
    args = p.parse_args()
    b, length, planes = 32, 8192, 4
    case = sweep.build(b, length, planes, 16, 16, 128, 64, 16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for d in (0, 3):
        cell = torch.arange(b, dtype=torch.int32, device="cuda")
        depth = torch.full((b,), d, dtype=torch.int32, device="cuda")
        pos = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
        off = ((cell * planes + d) * case["pages_per_plane"]).int()
        for bn in (int(x) for x in args.block_n.split(",")):
            def run() -> None:
                packed_attention_triton(case["q"], case["k_tail"], case["v_tail"], case["tables"], 16, case["packed"],
                                        cell, depth, pos, off, block_n=bn, num_splits=packed_splits(b, 16, length, sms))
            run()
            torch.cuda.synchronize()
            if not args.no_time:
                print(f"depth {d}, block_n {bn}: {sweep.time_ms(run, 10):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
