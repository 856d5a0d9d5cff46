"""pytest plugin: compile every Triton launch a test makes for an H100/H200 (sm_90) with the
Triton on the path, without a GPU, and launch nothing.

Why: the interpreter (`TRITON_INTERPRET=1`, what CI runs) executes kernels as Python and
accepts code that the compiler rejects; Triton 3.6, the H200 machine's, rejected kernels
that passed every interpreter test (a throwaway `_` reused inside a loop changes a
loop-carried type). This runs the compiler's whole path (front end, TTGIR, LLVM, ptxas)
on this machine's CPU, so such a kernel is caught before device time is spent.

Setup, once (Triton 3.6's wheel for this Python, unpacked beside the venv; ptxas comes with it):
    python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_27_x86_64 -d /tmp/triton36 triton==3.6.0
    mkdir -p /tmp/triton36/site && python3 -m zipfile -e /tmp/triton36/triton-*.whl /tmp/triton36/site
    chmod +x /tmp/triton36/site/triton/backends/nvidia/bin/*
Run (the kernel tests whose launches should compile; their value checks are not the point):
    PYTHONPATH=/tmp/triton36/site:tests python -m pytest -q -p compile_only tests/test_kernels_sparse_decode.py

The kernels run no program, so the tests' value checks fail; the session's exit status is
0 when every launch compiled (and at least one did) and 1 otherwise, and the summary lists
each kernel's compiled variants and the first error of each kernel that failed.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted

import pytest  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
kernels: dict[str, JITFunction] = {}
errors: dict[str, str] = {}


class _NoGPU:
    """The driver Triton asks for the target, device and stream: sm_90, device 0, stream 0."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_run = JITFunction.run


def _compile_only(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
    """JITFunction.run in warm-up mode: bind, specialize and compile; never launch."""
    name = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__qualname__}"
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:
        errors.setdefault(name, "".join(traceback.format_exception_only(type(e), e))[-2000:])
        raise
    kernels[name] = self
    return kernel


# At import, before conftest.py sets TRITON_INTERPRET=1 and imports the package: the
# kernels are decorated as compiled JITFunctions, the launches compile for sm_90 only, and
# the dispatchers route CPU tensors to Triton as they do under the interpreter.
driver.set_active(_NoGPU())
JITFunction.run = _compile_only
import specloop.kernels as _package  # noqa: E402

for _module in pkgutil.iter_modules(_package.__path__):
    importlib.import_module(f"specloop.kernels.{_module.name}")
for _name, _mod in list(sys.modules.items()):
    if _name.startswith("specloop") and hasattr(_mod, "_INTERPRET"):
        _mod._INTERPRET = True
os.environ["TRITON_INTERPRET"] = "1"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tr = terminalreporter
    tr.section(f"compiled for sm_90 with triton {triton.__version__}")
    for name, fn in sorted(kernels.items()):
        tr.write_line(f"{name}: {len(fn.device_caches[0][0])} variant(s)")
    for name, message in errors.items():
        tr.write_line(f"COMPILE ERROR in {name}: {message}", red=True)
    if not kernels:
        tr.write_line("no kernel was launched", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.exitstatus = 1 if errors or not kernels else 0
