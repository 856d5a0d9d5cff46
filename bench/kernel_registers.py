"""Registers, spills and shared memory of the packed reader compiled for sm_90, on the CPU.

No GPU: each launch is compiled (front end to ptxas) for an H100/H200 and not run, as in
tests/compile_only.py, then ptxas -v reports the cubin's resources. Registers bound the
reader's occupancy (bench/results/packed_reader_ncu_d94bad3_h100.json: 255 a thread, two
programs of 4 warps a multiprocessor), so a change to the kernel can be checked here
before device time is spent. Both kernels are reported: the sealed pass (`packed_sealed`)
and the general kernel.

    python bench/kernel_registers.py --block-n 32,64 --warps 4,8 --max-registers default,128
    PYTHONPATH=/tmp/triton36/site python bench/kernel_registers.py   # the device's Triton (setup: compile_only.py)
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled JITFunctions, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


class _NoGPU:
    """The driver Triton asks for the target, device and stream: sm_90, device 0, stream 0."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


compiled: list = []
_run = JITFunction.run


def _compile_only(self: JITFunction, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append((self.fn.__name__, kernel))
    return kernel


def _ptxas() -> str:
    """Triton's own ptxas that reads its PTX version (3.9 emits PTX newer than CUDA 13.0's)."""
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (here / name).exists():
            return str(here / name)
    return "ptxas"


def resources(ptx: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(lines) or out.stderr.strip()[-300:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-n", default="32,64")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--max-registers", default="default")
    p.add_argument("--sealed", default="on,off", help="on: the sealed pass first (packed_sealed), off: the general kernel alone")
    p.add_argument("--sealed-warps", default="4")
    p.add_argument("--sealed-chunk", default="32")
    args = p.parse_args()
    driver.set_active(_NoGPU())
    JITFunction.run = _compile_only
    import packed_reader_sweep as sweep
    from specloop.kernels import packed_attention
    packed_attention._INTERPRET = False  # the GPU's dtype choices (bf16 products)
    b, planes, length = 2, 4, 256
    case = sweep.build(b, length, planes, 16, 16, 128, 64, 16, "cpu")
    cell = torch.arange(b, dtype=torch.int32)
    depth = torch.full((b,), 3, dtype=torch.int32)
    position = torch.full((b,), length - 1, dtype=torch.int32)
    offset = ((cell * planes + 3) * case["pages_per_plane"]).int()
    print(f"triton {triton.__version__}, ptxas {_ptxas()}", flush=True)
    for bn, warps, regs, sealed, sealed_warps, chunk in itertools.product(
            args.block_n.split(","), args.warps.split(","), args.max_registers.split(","), args.sealed.split(","),
            args.sealed_warps.split(","), args.sealed_chunk.split(",")):
        compiled.clear()
        packed_attention.packed_attention_triton(
            case["q"], case["k_tail"], case["v_tail"], case["tables"], 16, case["packed"], cell, depth, position,
            offset, block_n=int(bn), num_warps=int(warps), num_splits=2, sealed=sealed == "on",
            sealed_warps=int(sealed_warps), sealed_chunk=int(chunk), max_registers=None if regs == "default" else int(regs))
        for name, kernel in compiled:
            if name == "_attention_kernel":
                print(f"general kernel: block_n {bn}, warps {warps}, max registers {regs}, after sealed {sealed}: "
                      f"shared {kernel.metadata.shared} B; {resources(kernel.asm['ptx'])}", flush=True)
            elif name == "_row_kernel":
                print(f"one-lane sealed pass: warps {sealed_warps}: shared {kernel.metadata.shared} B; "
                      f"{resources(kernel.asm['ptx'])}", flush=True)
            elif name == "_sealed_kernel":
                print(f"sealed pass: warps {sealed_warps}, chunk {chunk}: shared {kernel.metadata.shared} B; "
                      f"{resources(kernel.asm['ptx'])}", flush=True)


if __name__ == "__main__":
    main()
