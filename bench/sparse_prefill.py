"""FlashLoop token-sparse prefill against dense prefill: TTFT, FLOPs, selection cost.

Usage (device machine; a random checkpoint is written first):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/sparse_prefill.py --model /tmp/ouro14 --out bench/results/sparse_prefill_h200.json
CPU smoke run:
    python -m specloop.cli random-checkpoint /tmp/tiny --preset tiny
    python bench/sparse_prefill.py --model /tmp/tiny --out /tmp/sparse_prefill_cpu.json --device cpu \\
        --lengths 64,96 --window 16 --repeats 1

Cases: one prompt of each `--lengths` with max_tokens=1 (greedy, ignore_eos), dense (the
feature off) and token-sparse with `--window` (plus any `--windows`) and `--retention`.
Every engine gets the same options (baseline.py's: max_num_seqs 128, 2048 batched tokens,
the default attention backend, CUDA graphs) and the same explicit KV pool, sized for the
longest prompt plus a margin; all engines share one loaded, fused model. When the pools of
all variants fit the GPU together, the engines live side by side and the timed runs
alternate between them (the order rotating each repeat) to spread drift; otherwise each
engine is built, measured and dropped in turn (`alternated: false` in the record).

Per case and engine: one untimed warm-up run (kernels compile; it also counts the rows each
forward call runs and, for sparse, records every window's kept set through the runner's
probe), then `--repeats` timed runs: TTFT is the wall time from add_request to the first
token (synchronised before the start; the token arrives after its ticket's event). Peak CUDA
memory is reset before each timed run. A last, separate run of each sparse engine wraps
`sparse_prefill.select` / `inherit` / `fill_rows` (the module attributes the runner calls)
with CUDA events before and after each call (summed after one sync at the end; on CPU: wall
time), counts the window groups, and times each forward call's host side (submit) and each
engine step, with and without a selection in it.

FLOPs are analytic (matmuls only): per loop, the rows that run x 2 x the layer stack's
matmul parameters, plus causal attention 4 x head_dim x heads x layers x (keys per query:
p + 1 for a query at position p) summed over the queries that run, plus the lm_head for the
last token. Sparse rows per window and loop are TokenSparsePrefill.budget; the analytic
attention count places a window's kept queries uniformly over it, the "measured" one uses the
kept sets the warm-up recorded. Floors: FLOPs / 790 TFLOP/s (../shared/docs/gpu.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.flashloop.config import TokenSparsePrefill
from specloop.flashloop.token_sparse_prefill import select as sparse_prefill
from specloop.flashloop.token_sparse_prefill.batch import WindowBatch
from specloop.flashloop.token_sparse_prefill.device import WindowDevice
from specloop.runtime.kv_format import PagedKV
from specloop.sampling_params import SamplingParams

MATMUL = 790e12  # bf16 FLOP/s on the H200 (gpu.md)
TARGET_RATIO = 0.65  # sparse / dense TTFT at 8K (the issue's target)
TARGET_LENGTH = 8192
SELECTION_CALLS = ("select", "inherit", "fill_rows")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ---- one prefill ----------------------------------------------------------------------------

def prefill(engine: EngineCore, prompt: list[int], request_id: str, cuda: bool,
            on_step: Any = None) -> dict[str, Any]:
    """One request, max_tokens=1: TTFT (s) and the engine steps it took. `on_step(step_fn)`
    may wrap each step (the selection run times them)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _sync(cuda)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    steps = 0
    while engine.has_unfinished():
        outs = on_step(engine.step) if on_step is not None else engine.step()
        steps += 1
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"request {request_id} produced no token")
    return {"ttft_s": ttft, "steps": steps}


# ---- instrumentation (untimed runs only) --------------------------------------------------

class RowCounter:
    """Wraps the runner's ForwardBatchBuilder.build: forward calls and rows per loop pass."""

    def __init__(self, engine: EngineCore) -> None:
        self.batches = engine.executor.runner.batches
        self.calls = 0
        self.rows = 0  # real rows over all passes (token-loops run)
        self.padded_rows = 0  # rows incl. padding up to CUDA graph buckets
        self.window_groups = 0
        build = self.batches.build

        def counted(plan: Any) -> Any:
            batch = build(plan)
            self.calls += 1
            self.rows += sum(lp.num_rows for lp in batch.passes)
            self.padded_rows += sum(max(lp.bucket, lp.num_rows) for lp in batch.passes)
            windows = batch.notes.get(WindowBatch)
            self.window_groups += len(windows.windows) if windows is not None else 0
            return batch

        self.batches.build = counted

    def remove(self) -> None:
        del self.batches.__dict__["build"]

    def record(self) -> dict[str, int]:
        return {"forward_calls": self.calls, "rows_run": self.rows, "rows_incl_padding": self.padded_rows,
                "window_groups": self.window_groups}


class KeptProbe:
    """The runner's test probe: each window's kept mask at each sparse depth (kept on the
    device until the run ends)."""

    def __init__(self, engine: EngineCore) -> None:
        [self.windows] = [f for f in engine.features if isinstance(f, WindowDevice)]
        self.kept: list[tuple[int, int, int, torch.Tensor]] = []  # (start, depth, budget, mask)
        self.windows.probe = lambda w, mask: self.kept.append((w.start, w.depth, w.budget, mask))

    def remove(self) -> dict[tuple[int, int], list[int]]:
        """{(window start, depth): kept positions}; checks each kept set has its budget."""
        self.windows.probe = None
        out = {}
        for start, depth, budget, mask in self.kept:
            positions = (start + torch.nonzero(mask.cpu()).flatten()).tolist()
            if len(positions) != budget:
                raise AssertionError(f"window at {start}, depth {depth}: kept {len(positions)}, budget {budget}")
            out[(start, depth)] = positions
        return out


class SelectionTimer:
    """Wraps the sparse_prefill functions the runner calls, and the engine's submit and step."""

    def __init__(self, engine: EngineCore, cuda: bool) -> None:
        self.cuda = cuda
        self.events: dict[str, list[tuple[Any, Any]]] = {n: [] for n in SELECTION_CALLS}
        self.wall: dict[str, float] = {n: 0.0 for n in SELECTION_CALLS}  # CPU: the call's wall time
        self.host: dict[str, float] = {n: 0.0 for n in SELECTION_CALLS}  # host time inside the calls
        self.calls: dict[str, int] = {n: 0 for n in SELECTION_CALLS}
        self.groups: dict[str, int] = {"select": 0, "fill_rows": 0}  # windows selected, groups filled
        self.originals = {n: getattr(sparse_prefill, n) for n in SELECTION_CALLS}
        for name, fn in self.originals.items():
            setattr(sparse_prefill, name, self._wrap(name, fn))
        self.executor = engine.executor
        submit = self.executor.submit
        self.submits: list[tuple[float, int]] = []  # (host s, selects in it)

        def timed_submit(plan: Any) -> Any:
            before = self.calls["select"]
            t0 = time.perf_counter()
            ticket = submit(plan)
            self.submits.append((time.perf_counter() - t0, self.calls["select"] - before))
            return ticket

        self.executor.submit = timed_submit
        self.steps: list[tuple[float, int]] = []  # (wall s, selects in it)

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            dt = time.perf_counter() - t0
            if self.cuda:
                end.record()
                self.events[name].append((begin, end))
            else:
                self.wall[name] += dt  # synchronous on CPU
            self.host[name] += dt
            self.calls[name] += 1
            wb = args[1] if name == "select" else args[0] if name == "fill_rows" else None
            if wb is not None:  # one call serves every window group of a forward call
                self.groups[name] += sum(w.rank == 0 for w in wb.windows) if name == "select" else len(wb.windows)
            return result
        return timed

    def step(self, step_fn: Any) -> Any:
        before = self.calls["select"]
        t0 = time.perf_counter()
        outs = step_fn()
        self.steps.append((time.perf_counter() - t0, self.calls["select"] - before))
        return outs

    def remove(self) -> None:
        for name, fn in self.originals.items():
            setattr(sparse_prefill, name, fn)
        del self.executor.__dict__["submit"]

    def record(self) -> dict[str, Any]:
        """After the run (one sync here): device ms per function and in all, host times."""
        _sync(self.cuda)
        if self.cuda:
            device_ms = {n: sum(b.elapsed_time(e) for b, e in ev) for n, ev in self.events.items()}
        else:
            device_ms = {n: 1e3 * s for n, s in self.wall.items()}

        def split(pairs: list[tuple[float, int]]) -> dict[str, Any]:
            with_sel = [1e3 * t for t, n in pairs if n]
            without = [1e3 * t for t, n in pairs if not n]
            return {"count": len(pairs), "with_selection": len(with_sel), "without_selection": len(without),
                    "median_ms_with_selection": statistics.median(with_sel) if with_sel else None,
                    "median_ms_without_selection": statistics.median(without) if without else None,
                    "total_ms_with_selection": sum(with_sel), "total_ms_without_selection": sum(without),
                    "all_ms": [round(1e3 * t, 4) for t, _ in pairs], "selects": [n for _, n in pairs]}

        return {"timing": "CUDA events around each call (GPU timeline, including any launch gaps)"
                          if self.cuda else "wall time around each call (CPU: synchronous)",
                "ms": {**{n: round(v, 4) for n, v in device_ms.items()}, "total": round(sum(device_ms.values()), 4)},
                "host_ms": {**{n: round(1e3 * v, 4) for n, v in self.host.items()},
                            "total": round(1e3 * sum(self.host.values()), 4)},
                "calls": dict(self.calls),
                "windows_selected": self.groups["select"], "window_groups": self.groups["fill_rows"],
                "forward_calls_host": split(self.submits), "engine_steps_wall": split(self.steps)}


# ---- FLOPs ----------------------------------------------------------------------------------

def stack_matmul_params(model: Any) -> int:
    """Matmul weights of the layer stack (fused or not: the same count)."""
    return sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)


def _keys(start: int, end: int) -> int:
    """Sum of (p + 1) over positions [start, end): keys read by those causal queries."""
    return (end * (end + 1) - start * (start + 1)) // 2


def flops(cfg: Any, stack_params: int, length: int, sparse: TokenSparsePrefill | None,
          kept: dict[tuple[int, int], list[int]] | None = None) -> dict[str, Any]:
    """Analytic prefill FLOPs; `kept` (the recorded kept sets) replaces the uniform placement."""
    per_key = 4 * cfg.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers
    rows, keys = [], []
    window = sparse.window if sparse is not None else length
    for depth in range(cfg.num_loops):
        r = k = 0
        for start in range(0, length, window):
            end = min(start + window, length)
            n = end - start
            if sparse is None or not sparse.sparse(depth, n):
                r += n
                k += _keys(start, end)
                continue
            budget = sparse.budget(depth, n)
            r += budget
            if kept is not None:
                k += sum(p + 1 for p in kept[(start, depth)])
            else:
                k += budget * (start + (n + 1) / 2)  # kept queries spread evenly over the window
        rows.append(r)
        keys.append(k)
    linear = [2 * stack_params * r for r in rows]
    attention = [per_key * k for k in keys]
    head = 2 * cfg.hidden_size * cfg.vocab_size
    total = sum(linear) + sum(attention) + head
    return {"rows_per_loop": rows, "rows": sum(rows), "keys_per_loop": keys,
            "linear_tflop_per_loop": [x / 1e12 for x in linear],
            "attention_tflop_per_loop": [x / 1e12 for x in attention],
            "linear_tflop": sum(linear) / 1e12, "attention_tflop": sum(attention) / 1e12, "head_tflop": head / 1e12,
            "tflop": total / 1e12, "floor_ms": 1e3 * total / MATMUL}


# ---- the benchmark --------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    name: str
    sparse: TokenSparsePrefill | None
    engine: EngineCore | None = None
    build_s: float = 0.0
    cases: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _drop(variant: Variant, cuda: bool) -> None:
    variant.engine = None
    gc.collect()  # its CUDA graphs hold a reference cycle
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--lengths", default="8192,32768", help="prompt lengths, comma-separated")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", default="", help="more windows to measure, comma-separated")
    p.add_argument("--retention", default="1,1,0.25,0.10")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-margin", type=float, default=0.10, help="KV pool = longest prompt's pages x (1 + margin)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time (no alternation), even when all pools fit together")
    args = p.parse_args()

    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    lengths = _ints(args.lengths)
    windows = list(dict.fromkeys([args.window] + _ints(args.windows)))
    retention = _floats(args.retention)

    t_load = time.perf_counter()
    model = load_model(args.model, dtype=dtype, device=dev)[0].fuse_projections()  # as EngineCore loads it
    if cuda:
        torch.cuda.empty_cache()
    tokenizer = load_tokenizer(args.model)
    load_s = time.perf_counter() - t_load
    cfg = model.config
    stack_params = stack_matmul_params(model)

    # One explicit KV pool for every engine: the longest prompt (+1 token) in every plane, plus margin.
    page_bytes = PagedKV.page_bytes(cfg.num_hidden_layers, args.block_size, cfg.num_key_value_heads,
                                    cfg.head_dim, model.dtype)
    need_pages = cfg.num_loops * -(-(max(lengths) + 1) // args.block_size)
    pool_pages = math.ceil(need_pages * (1 + args.kv_margin)) + cfg.num_loops
    pool_bytes = (pool_pages + 1) * page_bytes  # the engine adds one sink page

    variants = [Variant("dense", None)] + [
        Variant(f"sparse_w{w}", TokenSparsePrefill.parse({"window": w, "retention": retention})) for w in windows]

    def build(v: Variant) -> EngineCore:
        config = EngineConfig(model=args.model, dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                              block_size=args.block_size, num_kv_pages=pool_pages,
                              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                              token_sparse_prefill=v.sparse)
        t0 = time.perf_counter()
        engine = EngineCore(config, model=model, tokenizer=tokenizer)
        if engine.max_model_len < max(lengths) + 1:
            raise SystemExit(f"max_model_len {engine.max_model_len} does not fit a {max(lengths)}-token prompt + 1")
        v.build_s = time.perf_counter() - t0
        return engine

    alternated = not args.sequential
    if cuda and alternated:
        free, _ = torch.cuda.mem_get_info(dev)
        # each engine: its pool plus slot storage and graph buffers; keep a few GiB for activations
        alternated = len(variants) * pool_bytes * 1.05 + (8 << 30) < free
        if not alternated:
            print(f"the {len(variants)} KV pools ({len(variants) * pool_bytes / 2**30:.1f} GiB) do not fit "
                  f"{free / 2**30:.1f} GiB free together: measuring one engine at a time", flush=True)

    counter = iter(range(1 << 30))

    def rid(v: Variant, tag: str) -> str:
        return f"{v.name}-{tag}-{next(counter)}"

    def warm_up(v: Variant, length: int) -> None:
        """Untimed: compiles kernels, counts rows, records kept sets (sparse)."""
        rows = RowCounter(v.engine)
        probe = KeptProbe(v.engine) if v.sparse is not None else None
        try:
            run = prefill(v.engine, _prompt(length, cfg.vocab_size, 7 * length + 999), rid(v, "warm"), cuda)
        finally:
            rows.remove()
            kept = probe.remove() if probe is not None else None
        case = v.cases.setdefault(length, {"length": length, "variant": v.name, "ttft_s": [], "peak_gib": [],
                                           "resident_gib": [], "steps": []})
        case["warmup_ttft_s"] = run["ttft_s"]
        case["counted"] = rows.record()
        case["flops"] = flops(cfg, stack_params, length, v.sparse)
        if kept is not None:
            case["flops_measured_kept_sets"] = flops(cfg, stack_params, length, v.sparse, kept)
        if case["counted"]["rows_run"] != case["flops"]["rows"]:
            print(f"note: {v.name} {length}: {case['counted']['rows_run']} rows ran, "
                  f"{case['flops']['rows']} analytic", flush=True)

    def timed(v: Variant, length: int, repeat: int) -> None:
        case = v.cases[length]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            resident = torch.cuda.memory_allocated()
        run = prefill(v.engine, _prompt(length, cfg.vocab_size, 7 * length + repeat), rid(v, "t"), cuda)
        case["ttft_s"].append(run["ttft_s"])
        case["steps"].append(run["steps"])
        if cuda:
            case["peak_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
            case["resident_gib"].append(resident / 2**30)

    def selection(v: Variant, length: int) -> None:
        timer = SelectionTimer(v.engine, cuda)
        try:
            run = prefill(v.engine, _prompt(length, cfg.vocab_size, 7 * length + 555), rid(v, "sel"), cuda,
                          on_step=timer.step)
        finally:
            timer.remove()
        rec = timer.record()
        rec["ttft_s_instrumented"] = run["ttft_s"]
        v.cases[length]["selection"] = rec

    def measure_length(group: list[Variant], length: int) -> None:
        for v in group:
            warm_up(v, length)
        for r in range(args.repeats):  # rotate the order each repeat
            for i in range(len(group)):
                timed(group[(i + r) % len(group)], length, r)
        for v in group:
            if v.sparse is not None:
                selection(v, length)

    t_bench = time.perf_counter()
    summaries: dict[str, Any] = {}
    if alternated:
        for v in variants:
            v.engine = build(v)
            summaries[v.name] = {"config": v.engine.config.summary(), "num_kv_pages": v.engine.kv.num_pages,
                                 "build_s": v.build_s}
        for length in lengths:
            measure_length(variants, length)
            print(f"{length}: done", flush=True)
        for v in variants:
            _drop(v, cuda)
    else:
        for v in variants:
            v.engine = build(v)
            summaries[v.name] = {"config": v.engine.config.summary(), "num_kv_pages": v.engine.kv.num_pages,
                                 "build_s": v.build_s}
            for length in lengths:
                measure_length([v], length)
            _drop(v, cuda)
            print(f"{v.name}: done", flush=True)
    bench_s = time.perf_counter() - t_bench

    # ---- summarise
    for v in variants:
        for case in v.cases.values():
            case["ttft_median_s"] = statistics.median(case["ttft_s"])
            if cuda:
                case["peak_gib_max"] = max(case["peak_gib"])
                case["activation_peak_gib_max"] = max(pk - rs for pk, rs in zip(case["peak_gib"], case["resident_gib"]))
    dense = variants[0]
    comparisons = []
    for length in lengths:
        d = dense.cases[length]
        for v in variants[1:]:
            s = v.cases[length]
            ratio = s["ttft_median_s"] / d["ttft_median_s"]
            sel = s["selection"]
            comparisons.append({
                "length": length, "window": v.sparse.window, "retention": list(v.sparse.retention),
                "dense_ttft_ms": 1e3 * d["ttft_median_s"], "sparse_ttft_ms": 1e3 * s["ttft_median_s"],
                "ttft_ratio": ratio,
                "target": TARGET_RATIO if length == TARGET_LENGTH else None,
                "meets_target": ratio <= TARGET_RATIO if length == TARGET_LENGTH else None,
                "dense_tflop": d["flops"]["tflop"], "sparse_tflop": s["flops"]["tflop"],
                "flops_ratio": s["flops"]["tflop"] / d["flops"]["tflop"],
                "sparse_tflop_measured_kept_sets": s["flops_measured_kept_sets"]["tflop"],
                "dense_flop_floor_ms": d["flops"]["floor_ms"], "sparse_flop_floor_ms": s["flops"]["floor_ms"],
                "selection_ms": sel["ms"]["total"],
                "selection_share_of_ttft": 1e-3 * sel["ms"]["total"] / s["ttft_median_s"],
                "selection_host_ms": sel["host_ms"]["total"], "windows_selected": sel["windows_selected"],
                "window_groups": sel["window_groups"],
            })

    result = {
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "model": str(Path(args.model)),
        "shape": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
                  "loops": cfg.num_loops, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                  "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "stack_matmul_params": stack_params},
        "dtype": dtype,
        "lengths": lengths, "windows": windows, "retention": retention, "repeats": args.repeats,
        "kv_pool": {"pages": pool_pages, "pages_needed_longest": need_pages, "page_bytes": page_bytes,
                    "gib": pool_bytes / 2**30, "margin": args.kv_margin},
        "alternated": alternated,
        "load_s": load_s, "bench_s": bench_s,
        "engines": summaries,
        "flops_note": "analytic matmul FLOPs: rows x 2 x stack matmul params per loop, causal attention "
                      "4 x head_dim x heads x layers per (query, key), lm_head for the last token; the exit "
                      "gate, norms and selection are left out. Sparse 'tflop' places kept queries evenly in "
                      "their window; 'flops_measured_kept_sets' uses the kept sets of the warm-up run",
        "ttft_note": "wall time add_request -> first token, median of the timed runs; timed runs alternate "
                     "between the variants when 'alternated'",
        "cases": [case for v in variants for case in v.cases.values()],
        "comparisons": comparisons,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(f"model loaded in {load_s:.1f} s, benchmark {bench_s:.1f} s, KV pool {pool_bytes / 2**30:.2f} GiB per "
          f"engine, {'alternated' if alternated else 'one engine at a time'}; wrote {args.out}")
    for v in variants:
        for length, case in v.cases.items():
            mem = f", peak {case['peak_gib_max']:.1f} GiB (+{case['activation_peak_gib_max']:.2f} over resident)" \
                if cuda else ""
            print(f"  {v.name:12s} {length:6d}: TTFT {', '.join(f'{1e3 * t:.1f}' for t in case['ttft_s'])} ms, "
                  f"{case['counted']['forward_calls']} forward calls, {case['counted']['rows_run']} rows{mem}")
    print(f"{'length':>6s} {'window':>6s} {'dense ms':>10s} {'sparse ms':>10s} {'ratio':>6s} {'target':>9s} "
          f"{'dense TF':>9s} {'sparse TF':>9s} {'FLOPs':>6s} {'select ms':>9s} {'share':>6s} {'groups':>6s}")
    for c in comparisons:
        target = "" if c["target"] is None else ("<=0.65 " + ("ok" if c["meets_target"] else "NO"))
        print(f"{c['length']:6d} {c['window']:6d} {c['dense_ttft_ms']:10.1f} {c['sparse_ttft_ms']:10.1f} "
              f"{c['ttft_ratio']:6.3f} {target:>9s} {c['dense_tflop']:9.4g} {c['sparse_tflop']:9.4g} "
              f"{c['flops_ratio']:6.3f} {c['selection_ms']:9.2f} {100 * c['selection_share_of_ttft']:5.1f}% "
              f"{c['window_groups']:6d}")


if __name__ == "__main__":
    main()
