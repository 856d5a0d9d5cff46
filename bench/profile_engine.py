"""Where one engine's forward calls spend CPU time (cProfile), batch 1, shipped model.

    python bench/profile_engine.py [cpu|cuda]
"""
import cProfile
import io
import pstats
import sys
import time

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.llm import default_model

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
for spec in [dict(), dict(speculation="block", draft_loops=1, num_speculative_tokens=4),
             dict(speculation="pipeline", draft_loops=1)]:
    eng = EngineCore(EngineConfig(model=str(default_model()), device=dev, dtype="float32", max_num_seqs=4,
                                  kv_cache_bytes=256 << 20, **spec))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 74))
    eng.add_request("w", prompt, params)
    eng.drain()
    n0 = eng.executor.num_submitted
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for i in range(4):
        eng.add_request(f"r{i}", prompt, params)
        eng.drain()
    pr.disable()
    if dev == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    fw = eng.executor.num_submitted - n0
    print(f"=== {spec}: {dt * 1e3 / fw:.2f} ms/forward over {fw} forwards, {dt * 1e3 / (4 * 48):.2f} ms/token")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    del eng
