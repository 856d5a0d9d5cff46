"""Greedy tokens of the serving engine on CUDA against the dense reference (fp64, CPU).

Usage: python bench/engine_gpu_check.py --out bench/results/engine_gpu_check.json
Runs the tiny random checkpoint in fp32 on the GPU (with adaptive exit on and off, several
requests in one batch, chunked prefill) and checks every token against the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from specloop.checkpoint import load_model
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint
from specloop.engine.sampling_params import SamplingParams
from specloop.llm import LLM
from specloop.model.reference import reference_greedy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, PRESETS["tiny"], seed=1, dtype=torch.float32)
        ref_model, _ = load_model(tmp, dtype=torch.float64)
        weights = {n: t for n, t in ref_model.named_parameters()}
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (1, 7, 30, 65, 130)]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for threshold in (1.0, 0.7):
            llm = LLM(tmp, device="cuda", dtype="float32", exit_threshold=threshold, max_num_batched_tokens=32)
            outs = llm.generate(prompts, params)
            for prompt, out in zip(prompts, outs):
                ref = reference_greedy(weights, ref_model.config, prompt, 16, threshold)
                results.append({"threshold": threshold, "prompt_len": len(prompt), "equal": out.token_ids == ref})
    summary = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name(),
               "cases": results, "all_equal": all(r["equal"] for r in results)}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
