"""Which Triton kernel variants an engine compiles after its warm-up, and why (CPU only).

Every new specialization of a kernel (a constexpr, an int argument's divisibility by 16 or
a pointer's 16-byte alignment) is a compile inside a request's time on the GPU. This runs
an engine on the CPU with the Triton backend under `tests/compile_only.py` (each launch
compiled for sm_90 with Triton 3.6, nothing run, outputs meaningless), serves a warm-up
prompt and then longer ones, and lists per prompt the variants that compiled and the
arguments that made each one new. Setup: `tests/compile_only.py`'s docstring.

    python -m specloop.cli random-checkpoint /tmp/tiny --preset tiny
    PYTHONPATH=/tmp/triton36/site python bench/compile_variants.py --model /tmp/tiny --variant all \\
        --prompts 1000,1900 --out /tmp/compile_variants_all.json

Clear Triton's cache (~/.triton/cache) first to time the compiles as well.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import compile_only  # noqa: E402  -- patches Triton before the kernels are imported
import torch  # noqa: E402

from specloop.engine.config import EngineConfig  # noqa: E402
from specloop.engine.core import EngineCore  # noqa: E402
from specloop.sampling_params import SamplingParams  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "prefill": {"token_sparse_prefill": {}},
    "sparse-decode": {"sparse_decode_attention": {"enabled": True}},
    "int4": {"kv_residual_quantization": {"tail": 64}},
    "all": {"token_sparse_prefill": {}, "sparse_decode_attention": {"enabled": True},
            "kv_residual_quantization": {"tail": 64}},
}


def _keys() -> dict[str, set]:
    return {name: set(fn.device_caches[0][0]) for name, fn in compile_only.kernels.items()}


def _spec(key: Any) -> list:
    """A kernel cache key's specialization list: (type, specialization) per argument."""
    text = re.sub(r"triton\.language\.(\w+)", r"'\1'", str(key).split("]{")[0] + "]")
    return ast.literal_eval(text)


def _why(name: str, key: Any, others: set) -> list[str]:
    """The arguments whose specialization differs from the nearest variant compiled before."""
    params = [p.name for p in compile_only.kernels[name].params]
    spec, best = _spec(key), None
    for other in others:
        o = _spec(other)
        diff = [f"{params[i]}: {o[i][1]!r} -> {spec[i][1]!r}" for i in range(len(spec)) if spec[i] != o[i]]
        best = diff if best is None or len(diff) < len(best) else best
    return best or ["first variant"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--variant", default="all", choices=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=256)
    p.add_argument("--prompts", default="1000,1900")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = EngineCore(EngineConfig.from_kwargs(
        args.model, device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=args.max_model_len, **VARIANTS[args.variant]))
    record: dict[str, Any] = {"command": " ".join(sys.argv), "variant": args.variant, "prompts": []}

    def serve(n: int, tokens: int) -> float:
        ids = torch.randint(3, engine.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        engine.add_request(f"p{n}", ids.tolist(), SamplingParams(max_tokens=tokens, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    took = serve(args.warmup, 4)
    print(f"warm-up {args.warmup}: {took:.1f} s, {sum(map(len, _keys().values()))} variants")
    before = _keys()
    for n in (int(x) for x in args.prompts.split(",")):
        took = serve(n, 8)
        after = _keys()
        new = {k: v - before.get(k, set()) for k, v in after.items() if v - before.get(k, set())}
        why = {k: [_why(k, key, after[k] - {key}) for key in v] for k, v in new.items()}
        print(f"prompt {n}: {took:.1f} s, {sum(map(len, new.values()))} new variants")
        for k, reasons in why.items():
            for r in reasons:
                print(f"  {k}: {', '.join(r)}")
        record["prompts"].append({"prompt": n, "seconds": took, "new": why})
        before = after
    if compile_only.errors:
        print("compile errors:", compile_only.errors)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
