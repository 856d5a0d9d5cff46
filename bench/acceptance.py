"""Speculation acceptance and speedup, per draft depth d and block size k.

Shipped model, CPU (held-out stdlib prompts; records acceptance traces for replay):
    python bench/acceptance.py --out bench/results/acceptance_default_cpu.json \
        --trace-out bench/results/acceptance_traces.json
GPU at the ouro-1.4b shape, verification outcomes replayed from those traces:
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/acceptance.py --model /tmp/ouro14 --device cuda --dtype bfloat16 \
        --replay bench/results/acceptance_traces.json --out bench/results/acceptance_ouro-1.4b_replay.json
Plot from a result file (no run):
    python bench/acceptance.py --plot bench/results/acceptance_default_cpu.json

Requests run one at a time (batch 1, where speculation pays most). For each temperature,
mode and (d, k): acceptance rate (accepted / drafted), mean acceptance length (tokens
emitted per round), per-position acceptance (of the rounds that drafted candidate i, the
share that accepted it), tokens per forward call, and wall-clock speedup over no
speculation with the same prompts and lengths (time per output token), against a
baseline run right before each case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.pipeline.replay import ReplayVerifier


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first held-out stdlib modules long enough."""
    from specloop.training.corpus import iter_split

    prompts = []
    for source in iter_split("heldout"):
        ids = tokenizer.encode(source.text, add_special_tokens=False)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"only {len(prompts)} held-out files have {length} tokens")


def random_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def run_case(engine: EngineCore, prompts: list[list[int]], params: SamplingParams, sync) -> dict:
    before = engine.stats()
    forwards = engine.executor.num_submitted
    produced = 0
    sync()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        produced += sum(len(o.token_ids) for o in engine.drain())
    sync()
    seconds = time.perf_counter() - start
    after = engine.stats()
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"seconds": seconds, "output_tokens": produced, "forwards": engine.executor.num_submitted - forwards,
            "ms_per_token": 1e3 * seconds / produced, "rounds": drafts, "drafted": drafted, "accepted": accepted}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="block,pipeline")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--ds", default="1,2,3")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--out")
    p.add_argument("--trace-out", help="write per-case accepted-count traces (for --replay)")
    p.add_argument("--replay", help="force verification outcomes from this trace file (label: replayed)")
    p.add_argument("--plot", help="only draw the PNG for this result file")
    p.add_argument("--markdown", help="only print this result file as a markdown table")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="KV pool per engine")
    p.add_argument("--kv-residual-quantization", default=None,
                   help="JSON group for every engine, the one without speculation included (INT4 residuals: "
                        "acceptance against a target with the same cache representation)")
    p.add_argument("--sparse-decode-attention", default=None,
                   help="JSON group for every engine, likewise (acceptance against a sparse-decode target)")
    p.add_argument("--token-sparse-prefill", default=None,
                   help="JSON group for every engine, likewise (the prompts' loops 3-4 sparse on both sides)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (sparse decode needs it on CUDA)")
    args = p.parse_args()
    if args.plot:
        plot(Path(args.plot))
        return
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    from specloop.llm import default_model

    model = args.model or default_model()
    ks = [int(x) for x in args.ks.split(",")]
    ds = [int(x) for x in args.ds.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    traces_in = json.loads(Path(args.replay).read_text()) if args.replay else None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    shared: dict = {"enforce_eager": True} if args.enforce_eager else {}
    for name in ("token_sparse_prefill", "kv_residual_quantization", "sparse_decode_attention"):
        if getattr(args, name):
            shared[name] = getattr(args, name)
    plain = EngineCore(EngineConfig.from_kwargs(model, device=args.device, dtype=args.dtype, max_num_seqs=4,
                                                kv_cache_bytes=args.kv_cache_bytes, **shared))

    def engine(verifier: ReplayVerifier | None = None, **spec) -> EngineCore:  # same weights, other speculation
        return EngineCore(EngineConfig.from_kwargs(model, device=args.device, dtype=args.dtype, max_num_seqs=4,
                                                   kv_cache_bytes=args.kv_cache_bytes, **shared, **spec),
                          plain.model, plain.tokenizer, verifier=verifier)

    prompts = (random_prompts(plain.model.config.vocab_size, args.prompts, args.prompt_len) if traces_in
               else heldout_prompts(plain.tokenizer, args.prompts, args.prompt_len))
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run_case(plain, prompts[:1], warm, sync)
    cases, traces = [], {}
    for temp in temps:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=0, ignore_eos=True)
        base = run_case(plain, prompts, params, sync)
        none_case = {"mode": "none", "temperature": temp, **base, "speedup": 1.0,
                     "tokens_per_forward": base["output_tokens"] / base["forwards"], "baseline_runs_ms_per_token": []}
        cases.append(none_case)
        print(f"T={temp} none: {base['ms_per_token']:.2f} ms/token", flush=True)
        settings = [("block", d, k) for d in ds for k in ks] if "block" in args.modes else []
        settings += [("pipeline", d, None) for d in ds] if "pipeline" in args.modes else []
        for mode, d, k in settings:
            spec = {"num_speculative_tokens": k} if k else {}
            key = f"d{d}_k{k}_t{temp}" if mode == "block" else f"pipeline_d{d}_t{temp}"
            replay = ReplayVerifier(traces_in[key]) if traces_in is not None else None
            eng = engine(replay, speculation=mode, draft_loops=d, **spec)
            run_case(eng, prompts[:1], warm, sync)
            if replay is not None:
                replay.rewind()  # the measured run replays the trace from its start
            eng.metrics = type(eng.metrics)(len(eng.metrics.accepted_per_position))  # measured run only
            # Paired baseline: the plain engine runs right before each case, so drifts in
            # host speed (this workload is launch-bound) hit both sides of the ratio alike.
            base = run_case(plain, prompts, params, sync)
            none_case["baseline_runs_ms_per_token"].append(base["ms_per_token"])
            res = run_case(eng, prompts, params, sync)
            m = eng.metrics
            traces[key] = list(m.accepted_trace)
            per_pos = [a / n if n else None for a, n in zip(m.accepted_per_position, m.drafted_per_position)]
            case = {"mode": mode, "temperature": temp, "draft_loops": d, "k": k, **res,
                    "acceptance_rate": res["accepted"] / res["drafted"] if res["drafted"] else 0.0,
                    "mean_acceptance_length": (res["accepted"] + res["rounds"]) / res["rounds"],
                    "per_position_acceptance": per_pos,
                    "tokens_per_forward": res["output_tokens"] / res["forwards"],
                    "baseline_ms_per_token": base["ms_per_token"],
                    "speedup": base["ms_per_token"] / res["ms_per_token"]}
            cases.append(case)
            del eng  # one speculating engine (and its KV pool) at a time
            print(f"T={temp} {mode} d={d} k={k}: accept {case['acceptance_rate']:.2f}, MAL "
                  f"{case['mean_acceptance_length']:.2f}, tok/fwd {case['tokens_per_forward']:.2f}, "
                  f"speedup {case['speedup']:.2f}", flush=True)
    result = {"command": " ".join(["python"] + sys.argv), "model": str(model), "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "dtype": args.dtype, "replayed": traces_in is not None,
              "prompts": {"count": len(prompts), "length": args.prompt_len,
                          "source": "random token ids" if traces_in else "held-out stdlib modules"},
              "max_tokens": args.max_tokens, "batch": 1,
              "token_sparse_prefill": plain.stats().token_sparse_prefill,
              "kv_residual_quantization": plain.stats().kv_residual_quantization,
              "sparse_decode_attention": plain.stats().sparse_decode_attention, "cases": cases}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.trace_out:
        Path(args.trace_out).write_text(json.dumps(traces))
    print(f"{'T':>4} {'mode':>8} {'d':>2} {'k':>2} {'accept':>7} {'MAL':>5} {'tok/fwd':>8} {'ms/tok':>8} {'speedup':>8}")
    for c in cases:
        print(f"{c['temperature']:4.1f} {c['mode']:>8} {c.get('draft_loops') or '-':>2} {c.get('k') or '-':>2} "
              f"{c.get('acceptance_rate', 0):7.2f} {c.get('mean_acceptance_length', 1):5.2f} "
              f"{c['tokens_per_forward']:8.2f} {c['ms_per_token']:8.2f} {c['speedup']:8.2f}")


def markdown(result: dict) -> str:
    """The cases of a result file as the table docs/speculation.md shows."""
    lines = ["| T | mode | d | k | acceptance | mean acceptance length | per-position acceptance | tokens / forward "
             "| ms / token | paired baseline ms / token | speedup |", "|" + "---|" * 11]
    for c in result["cases"]:
        drafted = list(c.get("per_position_acceptance", []))
        while drafted and drafted[-1] is None:  # positions no round drafted (a pipeline drafts one)
            drafted.pop()
        per_pos = ", ".join("–" if a is None else f"{a:.2f}" for a in drafted)
        if c["mode"] == "none":
            lines.append(f"| {c['temperature']:.1f} | none | – | – | – | 1.00 | – | {c['tokens_per_forward']:.2f} "
                         f"| {c['ms_per_token']:.1f} | – | 1.00 |")
            continue
        base = c.get("baseline_ms_per_token")
        lines.append(
            f"| {c['temperature']:.1f} | {c['mode']} | {c.get('draft_loops') or '–'} | {c.get('k') or '–'} "
            f"| {c['acceptance_rate']:.2f} | {c['mean_acceptance_length']:.2f} | {per_pos or '–'} "
            f"| {c['tokens_per_forward']:.2f} | {c['ms_per_token']:.1f} | {f'{base:.1f}' if base else '–'} "
            f"| {c['speedup']:.2f} |")
    return "\n".join(lines)


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    temps = sorted({c["temperature"] for c in result["cases"]})
    for temp in temps:
        block = [c for c in result["cases"] if c["mode"] == "block" and c["temperature"] == temp]
        for c in result["cases"]:
            if c["mode"] == "pipeline" and c["temperature"] == temp:
                style = "-" if temp == 0 else "--"
                axes[0].axhline(c["speedup"], ls=style, lw=0.8, color="k", alpha=0.4)
                axes[0].annotate(f"pipeline d={c['draft_loops']} T={temp}", (1, c["speedup"]), fontsize=7)
        for d in sorted({c["draft_loops"] for c in block}):
            rows = sorted((c for c in block if c["draft_loops"] == d), key=lambda c: c["k"])
            ks = [c["k"] for c in rows]
            style = "-" if temp == 0 else "--"
            axes[0].plot(ks, [c["speedup"] for c in rows], style, marker="o", label=f"d={d}, T={temp}")
            axes[1].plot(ks, [c["acceptance_rate"] for c in rows], style, marker="o", label=f"d={d}, T={temp}")
    label = " (replayed acceptance)" if result.get("replayed") else ""
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xlabel="k (candidates per round)", ylabel="speedup vs no speculation", title=f"speedup{label}")
    axes[1].set(xlabel="k (candidates per round)", ylabel="accepted / drafted", title=f"acceptance{label}")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"block self-speculation, {result['device_name']}, {result['dtype']}, batch 1")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
