"""INT4 cross-loop KV residuals against BF16 pages: bytes per token, peak memory, capacity, decode speed.

Usage (device machine; a random checkpoint is written first):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/kv_residual.py --model /tmp/ouro14 --out bench/results/kv_residual_h200.json
CPU smoke run:
    python -m specloop.cli random-checkpoint /tmp/tiny --preset tiny
    python bench/kv_residual.py --model /tmp/tiny --device cpu --out /tmp/kv_residual_cpu.json \\
        --lengths 300 --decode-tokens 8 --concurrent 4 --concurrent-prompt 100 --capacity-requests 3 \\
        --capacity-bytes 4000000 --capacity-prompt 200 --capacity-decode 8 --memory-bytes 40000000 \\
        --decode-bytes 40000000 --parts memory,decode,capacity

Variants: `bf16` (the format off) and `int4` (kv_residual_quantization with --tail), and with
--sparse also `int4+sparse` (token-sparse prefill at its defaults on top). Every engine
gets the same options: --attention-backend, CUDA graphs (or, with --eager, none),
max_num_seqs, max_num_batched_tokens, block size. One engine at a time.

Parts (--parts):
- memory: per --lengths prompt L, one request of L random tokens decoding --decode-tokens
  tokens. Sampled at its last decode step: the KV bytes it holds (BF16 pages and records,
  `stats().kv_bytes_per_request`) over its tokens, and the peak CUDA memory over the
  engine's resident memory (weights and pools) during the run.
- capacity: a byte pool of --capacity-bytes, --capacity-requests requests of
  --capacity-prompt tokens each decoding --capacity-decode tokens, submitted at once: the
  most requests running at once, preemptions, and the wall time.
- decode: decode throughput, batch 1 at each --lengths prompt and --concurrent requests of
  --concurrent-prompt tokens: generated tokens after each request's first, over the time
  from the last first token to the end (the decode phase).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    base = {"enforce_eager": True} if args.eager else {}
    out = {"bf16": dict(base), "int4": {**base, "kv_residual_quantization": {"tail": args.tail}}}
    if args.sparse:
        out["int4+sparse"] = {**out["int4"], "token_sparse_prefill": {}}
    return out


def engine_for(args: argparse.Namespace, model: Any, tokenizer: Any, options: dict[str, Any],
               pool: dict[str, Any]) -> EngineCore:
    cfg = EngineConfig.from_kwargs(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend, **pool, **options)
    return EngineCore(cfg, model=model, tokenizer=tokenizer)


def run(engine: EngineCore, prompts: dict[str, list[int]], max_tokens: int, cuda: bool,
        sample: str | None = None, stop_after: float | None = None) -> dict[str, Any]:
    """Run the prompts to the end; per-request first-token, last-token and end times, each
    step's end time, tokens emitted and requests emitting them (`steps`), the most running at
    once, and (sample) the request's held bytes at each step it ran. With stop_after, the
    requests still unfinished after that many seconds are aborted and `cut_s` says when: a
    case too long for one device call still reports what it did (`decode_phase`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _sync(cuda)
    start = time.perf_counter()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    done: dict[str, float] = {}
    cut = None
    tokens = {rid: 0 for rid in prompts}
    steps: list[tuple[float, int, int]] = []
    most, held = 0, []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - start  # one time a step: its outputs came out together
        if stop_after is not None and now > stop_after and cut is None:
            cut = now
            outputs = outputs + [o for rid in list(engine.requests) if (o := engine.abort(rid)) is not None]
        for o in outputs:
            assert o.error is None, o.error
            if o.token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
            tokens[o.request_id] += len(o.token_ids)
            if o.finished and o.finish_reason != "abort":
                done[o.request_id] = now
        steps.append((now, sum(len(o.token_ids) for o in outputs), sum(1 for o in outputs if o.token_ids)))
        most = max(most, len(engine.scheduler.running))
        if sample is not None:
            stats = engine.stats()
            if sample in stats.kv_bytes_per_request:
                held.append((tokens[sample], stats.kv_bytes_per_request[sample], stats.kv_record_bytes_used))
    _sync(cuda)
    return {"first": first, "last": last, "done": done, "tokens": tokens, "steps": steps, "most_running": most,
            "held": held, "wall_s": time.perf_counter() - start, "cut_s": cut,
            "preemptions": engine.scheduler.num_preemptions}


def decode_phase(r: dict[str, Any]) -> dict[str, Any]:
    """Decode speed from a `run`: the tokens emitted after the last first token over the time
    from it to the end, and the mean requests emitting in the steps that emitted any (every
    request is past its prompt then, so no prefill shares them; tokens that earlier requests
    decoded while later prompts ran are not counted; a speculative round's draft steps emit
    nothing and are left out of the mean), the mean time per output token over requests
    (their own first to last token, prefill steps of others included), and all output tokens
    over the whole run. A cut run (`cut_s`) has no decode phase of its own: it reports the
    requests that reached their first token and finished by then instead."""
    tpot = [(r["last"][k] - r["first"][k]) / (n - 1) for k, n in r["tokens"].items() if n > 1]
    out: dict[str, Any] = {"tpot_ms": 1e3 * sum(tpot) / len(tpot) if tpot else float("nan"),
                           "output_tok_s": sum(r["tokens"].values()) / r["wall_s"],
                           "first_tokens": len(r["first"]), "finished": len(r["done"]), "cut_s": r["cut_s"]}
    if r["cut_s"] is not None or not r["first"]:
        nan = float("nan")
        return {"decode_tok_s": nan, "decode_s": nan, "decode_batch": nan,
                "ttft_last_s": max(r["first"].values(), default=nan), **out}
    t0, t1 = max(r["first"].values()), max(r["done"].values())
    after = [(n, rows) for t, n, rows in r["steps"] if t > t0]
    emitting = [rows for _, rows in after if rows]
    return {"decode_tok_s": sum(n for n, _ in after) / (t1 - t0) if t1 > t0 else float("nan"),
            "decode_s": t1 - t0, "decode_batch": sum(emitting) / len(emitting) if emitting else 0.0,
            "ttft_last_s": t0, **out}


def memory_part(args, model, tokenizer, options, cuda, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for length in args.lengths:
        pool = {"kv_cache_bytes": args.memory_bytes}
        engine = engine_for(args, model, tokenizer, options, pool)
        resident = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        r = run(engine, {"m": _prompt(length, model.config.vocab_size, length)}, args.decode_tokens, cuda, sample="m")
        ttft = r["first"]["m"]
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        generated, held, records = r["held"][-1]
        tokens = length + generated
        out.append({"length": length, "tokens_held": tokens, "kv_bytes": held, "record_bytes": records,
                    "page_bytes": held - records, "bytes_per_token": held / tokens,
                    "peak_over_resident_gib": (peak - resident) / 2**30, "resident_gib": resident / 2**30,
                    "most_bytes_during_run": max(h[1] for h in r["held"]), "wall_s": r["wall_s"], "ttft_s": ttft})
        log(f"  memory {length}: {held / tokens / 1024:.1f} KiB/token ({held / 2**20:.0f} MiB, records "
            f"{records / 2**20:.0f} MiB), peak over resident {(peak - resident) / 2**30:.2f} GiB; TTFT {ttft:.2f} s, "
            f"{args.decode_tokens} tokens in {r['wall_s']:.2f} s")
        args.save()
        del engine
        _free(cuda)
    return out


def capacity_part(args, model, tokenizer, options, cuda) -> dict[str, Any]:
    engine = engine_for(args, model, tokenizer, options, {"kv_cache_bytes": args.capacity_bytes})
    prompts = {f"c{i}": _prompt(args.capacity_prompt, model.config.vocab_size, 100 + i)
               for i in range(args.capacity_requests)}
    r = run(engine, prompts, args.capacity_decode, cuda)
    out = {"pool_bytes": args.capacity_bytes, "requests": args.capacity_requests, "prompt": args.capacity_prompt,
           "decode": args.capacity_decode, "most_running": r["most_running"], "preemptions": r["preemptions"],
           "wall_s": r["wall_s"], "num_kv_pages": engine.kv.num_pages,
           "num_records": engine.kv.records.num_records if engine.kv.records is not None else 0}
    log(f"  capacity: at most {r['most_running']} of {args.capacity_requests} running at once, "
        f"{r['preemptions']} preemptions, {r['wall_s']:.1f} s")
    del engine
    _free(cuda)
    return out


def decode_part(args, model, tokenizer, options, cuda, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cases = [(1, length) for length in args.lengths] + [(args.concurrent, args.concurrent_prompt)]
    for count, length in cases:
        engine = engine_for(args, model, tokenizer, options, {"kv_cache_bytes": args.decode_bytes})
        prompts = {f"d{i}": _prompt(length, model.config.vocab_size, 200 + i) for i in range(count)}
        run(engine, {"warm": _prompt(min(length, 256), model.config.vocab_size, 7)}, 4, cuda)  # compile, warm
        r = run(engine, prompts, args.decode_tokens, cuda)
        phase = decode_phase(r)
        out.append({"requests": count, "prompt": length, "decode_tokens": args.decode_tokens, **phase,
                    "most_running": r["most_running"], "preemptions": r["preemptions"]})
        log(f"  decode {count} x {length}: {phase['decode_tok_s']:.1f} tok/s ({phase['decode_s']:.2f} s), "
            f"{phase['tpot_ms']:.1f} ms a token, last first token at {phase['ttft_last_s']:.2f} s")
        if args.save is not None:
            args.save()
        del engine
        _free(cuda)
    return out


def _free(cuda: bool) -> None:
    import gc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--parts", default="memory,capacity,decode")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    p.add_argument("--tail", type=int, default=64)
    p.add_argument("--sparse", action="store_true", help="add int4+sparse (token-sparse prefill on top)")
    p.add_argument("--eager", action="store_true", help="every engine without CUDA graphs")
    p.add_argument("--lengths", type=_ints, default=[8192, 32768])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--memory-bytes", type=int, default=40 << 30)
    p.add_argument("--decode-bytes", type=int, default=40 << 30)
    p.add_argument("--concurrent", type=int, default=128)
    p.add_argument("--concurrent-prompt", type=int, default=1024)
    p.add_argument("--capacity-bytes", type=int, default=20 << 30)
    p.add_argument("--capacity-requests", type=int, default=24)
    p.add_argument("--capacity-prompt", type=int, default=8192)
    p.add_argument("--capacity-decode", type=int, default=128,
                   help="tokens each decodes: long enough that early requests still run when the last is admitted")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto")
    args = p.parse_args()
    args.save = None
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    model.fuse_projections()
    tokenizer = load_tokenizer(args.model)
    all_variants = variants(args)
    chosen = args.variants.split(",") if args.variants else list(all_variants)
    parts = args.parts.split(",")
    record: dict[str, Any] = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
                              "args": {k: v for k, v in vars(args).items() if k != "save"}, "variants": {v: all_variants[v] for v in chosen}, "results": {}}
    for name in chosen:
        log(f"{name}:")
        options = all_variants[name]
        res: dict[str, Any] = {}
        record["results"][name] = res

        def save() -> None:  # after every part and case: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(record, indent=1, default=str))

        args.save = save
        if "memory" in parts:
            res["memory"] = []
            memory_part(args, model, tokenizer, options, cuda, res["memory"])
            save()
        if "capacity" in parts:
            res["capacity"] = capacity_part(args, model, tokenizer, options, cuda)
            save()
        if "decode" in parts:
            res["decode"] = []
            decode_part(args, model, tokenizer, options, cuda, res["decode"])
            save()
    record["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(record, indent=1))
    base = record["results"].get("bf16", {}).get("memory")
    for name, res in record["results"].items():
        for i, m in enumerate(res.get("memory", [])):
            ratio = base[i]["bytes_per_token"] / m["bytes_per_token"] if base else float("nan")
            log(f"{name:12s} {m['length']:6d}: {m['bytes_per_token'] / 1024:8.1f} KiB/token, {ratio:5.2f}x smaller "
                f"than bf16, peak +{m['peak_over_resident_gib']:.2f} GiB")
    log(f"wrote {args.out} in {record['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
