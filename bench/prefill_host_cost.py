"""Host time and Triton launches of one prompt's prefill, on the CPU, without a GPU.

Every Triton launch is compiled for sm_90 and not run (`tests/compile_only.py`, Triton 3.6
on the path: setup in its docstring), the torch ops run on the CPU, and the INT4 encoder
takes its Triton path as on CUDA. The INT4 launches whose results steer the run (the
encoding plan, the seal lookups) are followed by their torch references, not counted, so
the planes advance as on a GPU. What it shows is the host side of a GPU prefill: Python,
launch binding and the small torch ops a pass makes. On the H200 an INT4 8K prefill idled
the GPU 73% (docs/flashloop.md), so its launches bound it. Use a checkpoint with the real
layer count and small matrices, so the CPU's matmuls stay small:

    python -m specloop.cli random-checkpoint /tmp/tiny24 --preset tiny --num-hidden-layers 24 \\
        --num-key-value-heads 4 --max-position-embeddings 9000
    PYTHONPATH=/tmp/triton36/site python bench/prefill_host_cost.py --model /tmp/tiny24 --variant int4

It serves a warm-up prompt (compiles), then the timed one of the same length, and prints
the seconds, the forward calls and the launches per kernel (`--profile`: cProfile's top
functions by own time too; `--ops`: the torch ops that run kernels, per forward call, by
the two innermost specloop functions that issued them, the model's layers left out: on
the H100 an INT4 8K prompt ran about 500 of them a call, against dense's 15). Times are
this CPU's, not a GPU host's; compare variants in one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import compile_only  # noqa: E402,F401  -- patches Triton before the kernels are imported
from triton.runtime.jit import JITFunction  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from specloop.engine.config import EngineConfig  # noqa: E402
from specloop.engine.core import EngineCore  # noqa: E402
from specloop.kernels import packed_rows, residual_encode, seals as seal_kernels  # noqa: E402
from specloop.sampling_params import SamplingParams  # noqa: E402

VARIANTS = {"dense": {}, "int4": {"kv_residual_quantization": {}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", default="int4", choices=list(VARIANTS))
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--kv-bytes", type=int, default=512 << 20, help="KV cache bytes (the pool bounds INT4's chunks)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ops", action="store_true", help="count torch ops a forward call, by caller")
    args = ap.parse_args()
    residual_encode._INTERPRET = True  # fp32 here: nothing is rounded by hand
    engine = EngineCore(EngineConfig.from_kwargs(
        args.model, device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=8,
        kv_cache_bytes=args.kv_bytes, max_num_batched_tokens=args.rows, max_model_len=args.prompt + 8,
        **VARIANTS[args.variant]))
    vocab = engine.model.config.vocab_size
    store = getattr(engine.backend.kv, "planes", None)
    if store is not None:  # the INT4 encoder's Triton launch, as on CUDA
        store.encode_triton = True
        _plan_as_on_cuda(store)
        _seals_as_on_cuda()

    def serve(rid: str) -> tuple[float, int]:
        prompt = [3 + (i * 7) % (vocab - 3) for i in range(args.prompt)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        calls = engine.executor.num_submitted
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start, engine.executor.num_submitted - calls

    serve("warm-up")
    launches: collections.Counter = collections.Counter()
    run = JITFunction.run

    def counted(self, *a, **k):
        launches[self.fn.__name__] += 1
        return run(self, *a, **k)

    JITFunction.run = counted
    profiler = cProfile.Profile() if args.profile else None
    ops = _OpsByCaller() if args.ops else contextlib.nullcontext()
    if profiler:
        profiler.enable()
    with ops:
        seconds, calls = serve("timed")
    if profiler:
        profiler.disable()
    JITFunction.run = run
    print(f"{args.variant}: {seconds:.3f} s host, {calls} forward calls, {sum(launches.values())} Triton launches "
          f"{dict(launches)}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if args.ops:
        print(f"torch ops a forward call: {sum(ops.count.values()) / calls:.1f}")
        for caller, n in ops.count.most_common(25):
            print(f"  {n / calls:7.1f}  {caller}")


def _plan_as_on_cuda(store) -> None:
    """The INT4 encoding plan's Triton launch is compiled and counted, not run, but the
    planes' state must advance as on a GPU (else no group ever encodes and the prefill takes
    many more calls): after the launch, the torch path computes that state, its ops not
    counted."""
    triton_plan = type(store)._plan_encode_triton

    def plan(plan, committed, first):
        triton_plan(store, plan, committed, first)
        with _OpsByCaller.paused():
            store.encode_triton = False
            try:
                type(store).plan_encode(store, plan, committed, first)
            finally:
                store.encode_triton = True
            counts = [c.numel() for c in plan.cells]
            starts = tuple(sum(counts[:p]) for p in range(len(counts) + 1))
            fields = (plan.cells, plan.positions, plan.records, plan.ready, plan.table_offsets)
            plan.launch = (starts, *(torch.cat(f) for f in fields))
        return plan

    store._plan_encode_triton = plan


def _seals_as_on_cuda() -> None:
    """The seal lookups' launch is compiled and counted, not run; their values come from the
    torch reference, not counted (release scans read them)."""
    launch = seal_kernels.seals_triton

    def lookup(seal, group_tables, row_maps, cells, depth, positions):
        launch(seal, group_tables, row_maps, cells, depth, positions)
        with _OpsByCaller.paused():
            return packed_rows.seals(seal, group_tables, row_maps, cells, depth, positions)

    seal_kernels.seals_triton = lookup


class _OpsByCaller(TorchDispatchMode):
    """Counts the torch ops that compute (no views, no allocations) by their two innermost
    specloop callers outside the model's layers."""

    SKIP = ("view", "select", "slice", "empty", "detach", "alias", "expand", "unsqueeze", "as_strided")

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    _paused = False

    @classmethod
    @contextlib.contextmanager
    def paused(cls):
        """Ops run inside are not counted."""
        cls._paused = True
        try:
            yield
        finally:
            cls._paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self._paused and not any(word in name for word in self.SKIP):
            frames = [f for f in traceback.extract_stack(limit=16)
                      if "/specloop/" in f.filename and not f.filename.endswith("model/layers.py")]
            key = " < ".join(f"{f.filename.split('/specloop/')[1]}:{f.name}" for f in frames[-2:][::-1])
            self.count[key or "?"] += 1
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    main()
