"""FlashLoop token-sparse prefill and INT4 cross-loop KV residual quality against dense, on the shipped default model.

Usage (device machine, carrying out/stdlib_tokens.npz, the exact training corpus, made with
`python -m specloop.training.prepare --tokenizer specloop/assets/default_model --streams out/stdlib_tokens.npz`):
    PYTHONPATH=$PWD python bench/flashloop_quality.py --streams out/stdlib_tokens.npz \
        --out bench/results/flashloop_quality_h200.json
CPU smoke run (about 10 s on two cores; bench/results/flashloop_quality_cpu_smoke.json;
retention 1,1,1,1 must give exactly dense's numbers):
    python bench/flashloop_quality.py --device cpu --streams out/stdlib_tokens.npz --lengths 64 \
        --prompts 2 --windows 16,32 --continuation 8 --greedy-tokens 4 --schedule-windows 16 \
        --schedules 1,1,0.5,0.25 1,1,1,1 --out /tmp/fq.json
The KV residual configurations (tail 64) and dense only, on the GPU (an estimated 4-5
minutes on an H200 when the KV engines ran the torch attention backend; they now take the default one):
    PYTHONPATH=$PWD python bench/flashloop_quality.py --streams out/stdlib_tokens.npz \
        --only-kv --kv-residual --out bench/results/flashloop_quality_kv_h200.json
CPU smoke run of that part (about 40 s on two cores with OMP_NUM_THREADS=1;
bench/results/flashloop_quality_kv_cpu_smoke.json):
    python bench/flashloop_quality.py --device cpu --streams out/stdlib_tokens.npz --lengths 160 \
        --prompts 2 --continuation 8 --greedy-tokens 4 --only-kv --kv-residual --kv-tails 8,64 \
        --out /tmp/fqkv.json
Without --streams the held-out split of the running Python's stdlib is tokenised (other
files than the model's 3.11.7 corpus on another Python version; the JSON records which).

Prompts. For each prompt length P (--lengths) and its C true next tokens (--continuation),
--prompts windows of P + C tokens are taken from the held-out stream, one per held-out file
where possible: the files holding at least P + C tokens (in stream order, i.e. sorted
path order) are sampled evenly, and each window sits in the middle of its file, so no
prompt or continuation contains an end-of-text token or crosses a file boundary (more
prompts than such files put several evenly spaced windows in one file). --cross-files
instead takes evenly spaced offsets of the whole stream, boundaries included.

Configurations: dense; fixed windows of W prompt tokens (--windows) with --retention
(default 1,1,0.25,0.10, the RFC's); global selection (one window over the whole prompt)
with the same retention; and each of --schedule-windows (a window or "global") with each
alternative retention schedule of --schedules. --kv-residual adds, per tail T of --kv-tails
(default 64, the engine's), INT4 cross-loop KV residuals (4 bits, groups of 64, tail T) alone,
"kv-int4 tT", and with token-sparse prefill at window --kv-window (default 512, the engine's)
and --retention, "kv-int4 tT + wW"; --kv-policies serial,execution adds "kv-int4 tT exec",
the execution policy (its reference loss models one request alone, prompt passes of
--max-num-batched-tokens positions; the greedy engines batch a length's prompts, which can
move a request's pass starts). --only-kv (implies --kv-residual) runs dense and those
only. With groups of 64, a query at position q reads no quantized K/V before q >= 63 + T
(the first group's seal), so prompts should be well above that.

Measured per configuration and prompt length:
- teacher-forced loss, through the FlashLoop reference (`flashloop_forward`, plain PyTorch,
  full recomputation) on token_ids = prompt + continuation[:-1] with prompt_len = P, so the
  continuation positions are decode queries (dense, always active): mean NLL in nats of
  the C continuation tokens (logits at P-1 .. P+C-2). Reported: the mean over prompts, the
  mean per-prompt difference to dense with its paired standard error (std of the
  per-prompt differences / sqrt(n)), the same relative to dense's mean loss (%), the mean
  KL(dense || sparse) per position, top-1 agreement with dense's argmax on the C
  positions, top-1 accuracy against the true tokens, and the fraction of prompt
  token-loops computed (from the reference's active sets: sum over loops of active prompt
  tokens / (loops * P); 1.0 with KV residuals alone); all with the checkpoint's exit
  threshold unless --exit-threshold;
- for KV residual configurations, the quantization error from the reference's audit: per
  layer, plane (loop) and K/V, the largest |X^ - X| over the rows stored at that plane
  (reconstructed against exact, whether or not a query reads them reconstructed yet);
  reported per plane and K/V as err_max (max over layers and prompts), err_mean (mean over
  layers and prompts) and, for scale, absmax (mean over layers and prompts of max |X| of
  the exact K/V at that depth);
- greedy agreement, through the runtime (`EngineCore`, fp32, same device, one engine per
  configuration, all prompts of a length submitted at once; global selection is a window
  of max_model_len tokens, which holds every prompt; eager unless --cuda-graphs; KV residual
  configurations run `kv_residual_quantization={"tail": T, "policy": ...}` on the default
  attention backend (Triton's packed reader on CUDA), eager; the JSON's configs record
  each one's options): the
  fraction of prompts whose --greedy-tokens greedy tokens equal dense's exactly, and the
  mean length of the common prefix with dense's. Cross-checks of runtime against
  reference in the JSON: the fraction of prompts whose first engine token is the
  reference's argmax at P-1 (1.0 up to fp32 near-ties; a warning is printed otherwise), the
  largest difference over prompts between the engine's logprob of that token and the
  reference's (fp32 rounding; an engine that ignored a feature would be off by the
  feature's own effect, which the KV residual configurations' greedy tokens alone rarely
  show) and, where the engine counts them, the computed fraction from its skipped prompt
  token-loops.
The table printed at the end: per configuration and length, Δloss % ± paired std-err,
top-1 agreement and mean greedy prefix; then the computed fraction and the worst Δloss %;
then, for KV residual configurations, err_mean / err_max per K/V and plane over all lengths.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.flashloop.config import DEFAULT_WINDOW, RESIDUAL_BITS, RESIDUAL_GROUP
from specloop.model.flashloop_reference import FlashLoopAudit, FlashLoopFeatures, KVResidual, SparseDecode, \
    SparsePrefill, flashloop_forward
from specloop.sampling_params import SamplingParams
from specloop.training.token_data import ENDOFTEXT_ID

START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    window: int | None = None  # None with retention: global selection
    retention: tuple[float, ...] | None = None  # None: dense prefill
    kv_tail: int | None = None  # None: exact K/V; T: INT4 cross-loop KV residuals with tail T
    kv_policy: str = "serial"
    kv_chunk: int = 2048  # the execution policy's prompt chunk (the engines' max_num_batched_tokens)
    decode_retention: float | None = None  # None: dense decode attention; r: sparse decode, key retention r
    keep_last: bool = False  # token-sparse prefill: the prompt's last token runs every loop

    def features(self) -> FlashLoopFeatures:
        sparse = None if self.retention is None else SparsePrefill(window=self.window, retention=self.retention,
                                                                   keep_last=self.keep_last)
        kv = None if self.kv_tail is None else KVResidual(bits=RESIDUAL_BITS, group_size=RESIDUAL_GROUP,
                                                          tail=self.kv_tail, policy=self.kv_policy,
                                                          chunk=self.kv_chunk)
        decode = None if self.decode_retention is None else SparseDecode(key_retention=self.decode_retention)
        return FlashLoopFeatures(token_sparse_prefill=sparse, sparse_decode=decode, kv_residual=kv)

    def engine_group(self, max_model_len: int) -> dict[str, Any] | None:
        if self.retention is None:
            return None
        return {"window": self.window if self.window is not None else max_model_len, "retention": list(self.retention),
                "keep_last": self.keep_last}

    def engine_options(self, max_model_len: int) -> dict[str, Any]:
        """This configuration's engine options beyond the shared ones."""
        out: dict[str, Any] = {}
        group = self.engine_group(max_model_len)
        if group is not None:
            out["token_sparse_prefill"] = group
        if self.kv_tail is not None:
            out["kv_residual_quantization"] = {"tail": self.kv_tail, "policy": self.kv_policy}
        if self.decode_retention is not None:
            out["sparse_decode_attention"] = {"key_retention": self.decode_retention}
        return out

    def record(self, max_model_len: int) -> dict[str, Any]:
        """What the JSON says about this configuration."""
        options = self.engine_options(max_model_len)
        kv = self.features().kv_residual
        return {"name": self.name, "window": self.window, "keep_last": self.keep_last,
                "retention": None if self.retention is None else list(self.retention),
                "kv_residual": None if kv is None else dataclasses.asdict(kv),
                "engine_token_sparse_prefill": options.get("token_sparse_prefill"),
                "engine_kv_residual_quantization": options.get("kv_residual_quantization"),
                "decode_retention": self.decode_retention,
                "engine_sparse_decode_attention": options.get("sparse_decode_attention"),
                "engine_attention_backend": options.get("attention_backend", "auto")}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _fmt_retention(r: tuple[float, ...]) -> str:
    return ",".join(f"{x:g}" for x in r)


def build_configs(args: argparse.Namespace) -> list[Config]:
    base = _floats(args.retention)
    configs = [Config("dense")]
    if args.feature_matrix:  # each lazy update alone, then all three on
        r, t, w = args.decode_retention, args.kv_tails[0], args.kv_window
        return configs + [Config(f"w{w}", w, base), Config(f"decode k{r:g}", decode_retention=r),
                          Config(f"kv-int4 t{t}", kv_tail=t, kv_chunk=args.max_num_batched_tokens),
                          Config(f"w{w} + decode k{r:g}", w, base, decode_retention=r),
                          Config("all on", w, base, kv_tail=t, decode_retention=r)]
    if not args.only_kv:
        configs += [Config(f"w{w}", w, base) for w in args.windows]
        if not args.no_global:
            configs.append(Config("global", None, base))
        for sched in args.schedules:
            r = _floats(sched)
            for w in args.schedule_windows:
                window = None if w == "global" else int(w)
                configs.append(Config(f"{'global' if window is None else f'w{window}'} r={_fmt_retention(r)}",
                                      window, r))
    if args.kv_residual or args.only_kv:
        for t in args.kv_tails:
            if t < 1:
                raise SystemExit(f"--kv-tails: a tail must be a positive number of tokens, got {t}")
            for policy in args.kv_policies:
                tag = "" if policy == "serial" else " exec"
                chunk = args.max_num_batched_tokens
                configs.append(Config(f"kv-int4 t{t}{tag}", kv_tail=t, kv_policy=policy, kv_chunk=chunk))
                if policy == "serial":  # the execution reference models dense prefill chunks only
                    configs.append(Config(f"kv-int4 t{t} + w{args.kv_window}", args.kv_window, base, kv_tail=t))
    if args.keep_last:  # each token-sparse configuration again with the prompt's last token in every loop
        configs += [dataclasses.replace(c, name=c.name + " +last", keep_last=True) for c in configs
                    if c.retention is not None]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise SystemExit(f"duplicate configurations: {names}")
    return configs


def skip_configs(configs: list[Config], skip: list[str]) -> list[Config]:
    """Leave out the named configurations (dense stays: it is the baseline)."""
    unknown = sorted(set(skip) - {c.name for c in configs[1:]})
    if unknown:
        raise SystemExit(f"--skip: no configuration {unknown[0]!r}; there are {[c.name for c in configs[1:]]}")
    return [c for c in configs if c.name not in skip]


# --- corpus and prompts -----------------------------------------------------------------

def heldout_stream(args: argparse.Namespace, tokenizer: Any) -> tuple[np.ndarray, dict[str, Any], list[str] | None]:
    """The held-out token stream, what it is, and its files' paths when known."""
    if args.streams is not None:
        from specloop.training.token_data import load_streams

        streams, manifest = load_streams(args.streams)
        info = {"source": "streams", "path": str(args.streams), "corpus_python": manifest.get("python"),
                "stdlib": manifest.get("stdlib"), "heldout": manifest["splits"]["heldout"]}
        return streams["heldout"], info, None
    from specloop.training.corpus import load_split, python_version, stdlib_root
    from specloop.training.token_data import encode_files

    files = load_split("heldout", stdlib_root())
    stream = encode_files(tokenizer.backend_tokenizer, files)
    info = {"source": "stdlib", "path": str(stdlib_root()), "corpus_python": python_version(),
            "stdlib": str(stdlib_root()),
            "heldout": {"files": len(files), "bytes": sum(len(f.text.encode("utf-8")) for f in files),
                        "tokens": int(stream.size)}}
    return stream, info, [f.relpath for f in files]


def file_spans(stream: np.ndarray) -> list[tuple[int, int]]:
    """[begin, end) of each file's tokens (its end-of-text excluded), in stream order."""
    ends = np.flatnonzero(stream == ENDOFTEXT_ID).tolist()
    if not ends or ends[-1] != stream.size - 1:
        ends.append(stream.size)  # a tail without a terminator
    begins = [0] + [e + 1 for e in ends[:-1]]
    return list(zip(begins, ends))


def prompt_starts(stream: np.ndarray, need: int, count: int, cross_files: bool) -> list[tuple[int, int | None]]:
    """`count` deterministic window starts of `need` tokens: (start, file index or None)."""
    if stream.size < need:
        raise SystemExit(f"the held-out stream ({stream.size} tokens) is shorter than a window of {need}")
    if cross_files:
        span = stream.size - need
        return [((2 * i + 1) * span // (2 * count), None) for i in range(count)]
    spans = file_spans(stream)
    eligible = [i for i, (b, e) in enumerate(spans) if e - b >= need]
    if not eligible:
        raise SystemExit(f"no held-out file holds {need} tokens; use --cross-files")
    picks = [eligible[(2 * i + 1) * len(eligible) // (2 * count)] for i in range(count)]
    out = []
    for f in sorted(set(picks)):
        b, e = spans[f]
        m = picks.count(f)
        out += [(b + (k + 1) * (e - b - need) // (m + 1), f) for k in range(m)]
    return out


# --- teacher-forced loss ----------------------------------------------------------------

@torch.no_grad()
def score(weights: dict[str, torch.Tensor], mcfg: Any, prompt: torch.Tensor, cont: torch.Tensor,
          features: FlashLoopFeatures, exit_threshold: float | None) -> dict[str, Any]:
    """Continuation log-probs [C, V] (fp64), per-token NLL [C], the computed fraction and,
    with KV residuals, the reconstruction errors (`reconstruction_errors`)."""
    p = prompt.numel()
    ids = torch.cat([prompt, cont[:-1]])
    out = flashloop_forward(weights, mcfg, ids, p, features, exit_threshold)
    logp = torch.log_softmax(out.logits[p - 1:].double(), -1)
    nll = -logp.gather(-1, cont[:, None]).squeeze(-1)
    computed = float(out.active[:, :p].sum()) / (out.active.shape[0] * p)
    recon = None if features.kv_residual is None else reconstruction_errors(out.audit)
    exit_loop = float(out.exit_loops[p - 1:].double().mean())  # the scored positions' gate exits
    del out
    return {"logp": logp, "nll": nll, "computed": computed, "recon": recon, "exit": exit_loop}


def reconstruction_errors(audit: FlashLoopAudit) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Per (K/V, plane): each layer's max |X^ - X| over the rows stored at that plane ("err")
    and max |X| of its exact K/V at that depth ("absmax")."""
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    for (layer, plane, kind), err in sorted(audit.reconstruction_error.items()):
        exact = (audit.loop_keys if kind == "k" else audit.loop_values)[plane - 1, layer]  # [T, Hkv, D]
        row = out.setdefault((kind, plane), {"err": [], "absmax": []})
        row["err"].append(err)
        row["absmax"].append(float(exact.abs().max()))
    return out


def summarise_reconstruction(per_prompt: list[dict[tuple[str, int], dict[str, list[float]]]]
                             ) -> dict[str, dict[str, dict[str, float]]]:
    """{"k" | "v": {plane: {err_max, err_mean, absmax}}} over layers and prompts."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind, plane in sorted(per_prompt[0]):
        err = [e for r in per_prompt for e in r[(kind, plane)]["err"]]
        absmax = [a for r in per_prompt for a in r[(kind, plane)]["absmax"]]
        out.setdefault(kind, {})[str(plane)] = {"err_max": max(err), "err_mean": float(np.mean(err)),
                                                "absmax": float(np.mean(absmax))}
    return out


def _stats(values: list[float]) -> tuple[float, float | None]:
    a = np.asarray(values, dtype=np.float64)
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else None
    return float(a.mean()), se


# --- greedy through the engine ----------------------------------------------------------

@dataclasses.dataclass
class GreedyRun:
    """One configuration's engine run of one length's prompts."""

    tokens: list[list[int]]  # per prompt
    first_logprobs: list[float]  # per prompt: the engine's logprob of its first token
    skipped: int | None  # engine prompt token-loops skipped (None where it does not count them)
    seconds: float


def greedy_runs(args: argparse.Namespace, configs: list[Config], prompts: dict[int, list[list[int]]],
                max_model_len: int, num_loops: int) -> dict[str, dict[int, GreedyRun]]:
    params = SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    n = max(len(v) for v in prompts.values())
    block = 16
    longest = max(prompts) + args.greedy_tokens
    pages = (n * num_loops * (-(-longest // block) + 2)) * 5 // 4 + 64
    out: dict[str, dict[int, GreedyRun]] = {}
    for cfg in configs:
        kw: dict[str, Any] = dict(device=args.device, dtype="float32", max_model_len=max_model_len, block_size=block,
                                  num_kv_pages=pages, max_num_seqs=max(n, 1),
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enforce_eager=not args.cuda_graphs)
        if args.exit_threshold is not None:
            kw["exit_threshold"] = args.exit_threshold
        kw.update(cfg.engine_options(max_model_len))
        engine = EngineCore(EngineConfig.from_kwargs(str(args.model), **kw))
        out[cfg.name] = {}
        for length, batch in prompts.items():
            skipped_before = getattr(engine.stats(), "prefill_rows_skipped", None)
            t0 = time.perf_counter()
            for i, ids in enumerate(batch):
                engine.add_request(f"L{length}-{i}", ids, params)
            rids = [f"L{length}-{i}" for i in range(len(batch))]
            tokens: dict[str, list[int]] = {rid: [] for rid in rids}
            logprobs: dict[str, list[float]] = {rid: [] for rid in rids}
            while engine.has_unfinished():
                for o in engine.step():
                    if o.error is not None:
                        raise RuntimeError(f"{cfg.name} {o.request_id}: {o.error}")
                    tokens[o.request_id].extend(o.token_ids)
                    logprobs[o.request_id].extend(o.logprobs or [])
            skipped_after = getattr(engine.stats(), "prefill_rows_skipped", None)
            skipped = None if skipped_before is None else skipped_after - skipped_before
            seconds = time.perf_counter() - t0
            out[cfg.name][length] = GreedyRun([tokens[r] for r in rids], [logprobs[r][0] for r in rids], skipped,
                                              seconds)
            log(f"greedy {cfg.name:22s} L={length:5d}: {len(batch)} prompts x {args.greedy_tokens} tokens "
                f"in {seconds:.1f}s")
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --- main -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/flashloop_quality.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the shipped model)")
    p.add_argument("--streams", type=Path, default=None,
                   help="tokenised splits from specloop.training.prepare (default: tokenise the running stdlib)")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 2048, 4000])
    p.add_argument("--prompts", type=int, default=8, help="prompts per length")
    p.add_argument("--continuation", type=int, default=64, help="true next tokens scored after each prompt")
    p.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512, 1024])
    p.add_argument("--retention", default="1,1,0.25,0.10", help="schedule of the windowed and global configurations")
    p.add_argument("--no-global", action="store_true", help="leave out global selection")
    p.add_argument("--schedules", nargs="*", default=["1,1,0.5,0.25", "1,1,0.25,0.25"],
                   help="alternative retention schedules, each comma-separated")
    p.add_argument("--schedule-windows", type=lambda s: s.split(","), default=["256", "512"],
                   help="windows (or 'global') the alternative schedules run at")
    p.add_argument("--kv-residual", action="store_true",
                   help="add INT4 cross-loop KV residuals per --kv-tails, alone and with sparse prefill at --kv-window")
    p.add_argument("--kv-tails", type=lambda s: [int(x) for x in s.split(",")], default=[64],
                   help="tails of the KV residual configurations (positions past a group's last row before it is read "
                        "quantized)")
    p.add_argument("--kv-policies", type=lambda s: s.split(","), default=["serial"],
                   help="kv_residual_quantization policies (serial, execution); the execution reference seals at "
                        "one request's pass starts: every --max-num-batched-tokens prompt positions, then every token")
    p.add_argument("--kv-window", type=int, default=DEFAULT_WINDOW,
                   help="window of the KV residual + sparse prefill configurations (with --retention)")
    p.add_argument("--keep-last", action="store_true",
                   help="add each token-sparse configuration with keep_last (the prompt's last token in every loop)")
    p.add_argument("--only-kv", action="store_true", help="dense and the KV residual configurations only")
    p.add_argument("--feature-matrix", action="store_true",
                   help="dense, each lazy update alone (window --kv-window with --retention, sparse decode at "
                        "--decode-retention, INT4 residuals with the first --kv-tails), prefill + decode, all on")
    p.add_argument("--decode-retention", type=float, default=0.10, help="sparse decode attention's key retention")
    p.add_argument("--skip", nargs="*", default=[], help="configurations to leave out, by name")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens through the engine (0: skip)")
    p.add_argument("--exit-threshold", type=float, default=None, help="default: the checkpoint's")
    p.add_argument("--cross-files", action="store_true", help="evenly spaced stream offsets, file boundaries included")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine rows per forward call")
    p.add_argument("--cuda-graphs", action="store_true", help="let the engines capture CUDA graphs (slower start-up)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from specloop.assets import default_model_path

        args.model = default_model_path()
    device = torch.device(args.device)
    configs = skip_configs(build_configs(args), args.skip)
    model, _ = load_model(args.model, dtype=torch.float32, device=device)
    mcfg = model.config
    weights = {name: p.detach() for name, p in model.named_parameters()}
    tokenizer = load_tokenizer(args.model)
    for c in configs:
        if c.retention is not None and len(c.retention) != mcfg.num_loops:
            raise SystemExit(f"{c.name}: {len(c.retention)} retention values for {mcfg.num_loops} loops")
    context = mcfg.max_position_embeddings
    extra = max(args.continuation, args.greedy_tokens)
    too_long = [n for n in args.lengths if n + extra > context]
    if too_long:
        raise SystemExit(f"prompt lengths {too_long} + {extra} exceed the model's {context}-token context")
    if args.continuation < 1:
        raise SystemExit("--continuation must be at least 1")
    max_model_len = min(context, max(args.lengths) + extra)
    for t in sorted({c.kv_tail for c in configs if c.kv_tail is not None}):
        unread = [n for n in args.lengths if n + extra - 1 < RESIDUAL_GROUP - 1 + t]
        if unread:
            log(f"warning: with tail {t} no query of prompt lengths {unread} reads quantized K/V (the first group "
                f"seals at position {RESIDUAL_GROUP - 1 + t}): those KV residual numbers equal dense's")

    stream, corpus, paths = heldout_stream(args, tokenizer)
    corpus["python"] = platform.python_version()
    corpus["selection"] = ("evenly spaced offsets of the whole stream, file boundaries included" if args.cross_files
                           else "one window per held-out file long enough where possible (files sampled evenly in "
                                "stream order), in the middle of the file: no end-of-text token in any window")
    log(f"model {args.model} on {device} (fp32), held-out {corpus['source']} ({stream.size} tokens, corpus Python "
        f"{corpus['corpus_python']}), {len(configs)} configurations: {', '.join(c.name for c in configs)}")

    prompts: dict[int, list[list[int]]] = {}
    conts: dict[int, list[list[int]]] = {}
    placement: dict[str, list[dict[str, Any]]] = {}
    for length in args.lengths:
        starts = prompt_starts(stream, length + args.continuation, args.prompts, args.cross_files)
        prompts[length], conts[length], placement[str(length)] = [], [], []
        for s, f in starts:
            window = stream[s:s + length + args.continuation].astype(np.int64).tolist()
            prompts[length].append(window[:length])
            conts[length].append(window[length:])
            row: dict[str, Any] = {"offset": int(s), "file_index": f}
            if paths is not None and f is not None:
                row["file"] = paths[f]
            placement[str(length)].append(row)

    # Teacher-forced loss through the reference: dense first, then every configuration.
    fields = ("loss", "agree", "acc", "kl", "computed", "first", "first_logp", "recon", "seconds", "exit")
    raw: dict[str, dict[int, dict[str, list]]] = {c.name: {n: {f: [] for f in fields} for n in args.lengths}
                                                  for c in configs}
    for length in args.lengths:
        t0 = time.perf_counter()
        for i, (prompt, cont) in enumerate(zip(prompts[length], conts[length])):
            pt = torch.tensor(prompt, device=device)
            ct = torch.tensor(cont, device=device)
            base = None
            for c in configs:
                t1 = time.perf_counter()
                r = score(weights, mcfg, pt, ct, c.features(), args.exit_threshold)
                if base is None:
                    base = r
                top = r["logp"].argmax(-1)
                kl = (base["logp"].exp() * (base["logp"] - r["logp"])).sum(-1).mean()
                row = raw[c.name][length]
                row["loss"].append(float(r["nll"].mean()))
                row["agree"].append(float((top == base["logp"].argmax(-1)).double().mean()))
                row["acc"].append(float((top == ct).double().mean()))
                row["kl"].append(float(kl))
                row["computed"].append(r["computed"])
                row["exit"].append(r["exit"])
                row["first"].append(int(top[0]))  # the reference's first greedy token
                row["first_logp"].append(r["logp"][0].cpu())
                if r["recon"] is not None:
                    row["recon"].append(r["recon"])
                row["seconds"].append(time.perf_counter() - t1)
            deltas = " ".join(f"{c.name}:{raw[c.name][length]['loss'][-1] - raw['dense'][length]['loss'][-1]:+.4f}"
                              for c in configs[1:])
            log(f"loss L={length:5d} prompt {i + 1}/{len(prompts[length])}: dense "
                f"{raw['dense'][length]['loss'][-1]:.4f} nats; {deltas}")
        log(f"loss L={length}: {len(configs)} configurations x {len(prompts[length])} prompts in "
            f"{time.perf_counter() - t0:.1f}s")
    del weights, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    greedy = None
    if args.greedy_tokens > 0:
        greedy = greedy_runs(args, configs, prompts, max_model_len, mcfg.num_loops)

    results: dict[str, dict[str, Any]] = {}
    for c in configs:
        results[c.name] = {}
        for length in args.lengths:
            row, dense = raw[c.name][length], raw["dense"][length]
            diffs = [a - b for a, b in zip(row["loss"], dense["loss"])]
            d_mean, d_se = _stats(diffs)
            dense_mean = float(np.mean(dense["loss"]))
            entry: dict[str, Any] = {
                "prompts": len(row["loss"]),
                "loss_mean": float(np.mean(row["loss"])),
                "dense_loss_mean": dense_mean,
                "delta_loss": d_mean,
                "delta_loss_paired_stderr": d_se,
                "delta_loss_pct": 100 * d_mean / dense_mean,
                "delta_loss_pct_paired_stderr": None if d_se is None else 100 * d_se / dense_mean,
                "kl_from_dense": float(np.mean(row["kl"])),
                "top1_agree_dense": float(np.mean(row["agree"])),
                "top1_acc": float(np.mean(row["acc"])),
                "computed_fraction": float(np.mean(row["computed"])),
                "mean_exit_loop": float(np.mean(row["exit"])),
                "mean_exit_loop_shift": float(np.mean(row["exit"]) - np.mean(dense["exit"])),
                "reference_seconds": float(np.sum(row["seconds"])),
                "per_prompt": {"loss": row["loss"], "delta_loss": diffs, "top1_agree_dense": row["agree"],
                               "kl_from_dense": row["kl"], "computed_fraction": row["computed"]},
            }
            if row["recon"]:
                entry["reconstruction_error"] = summarise_reconstruction(row["recon"])
            if greedy is not None:
                run = greedy[c.name][length]
                mine, ref = run.tokens, greedy["dense"][length].tokens
                prefix = [common_prefix(a, b) for a, b in zip(mine, ref)]
                entry["greedy_exact_fraction"] = float(np.mean([a == b for a, b in zip(mine, ref)]))
                entry["greedy_prefix_mean"] = float(np.mean(prefix))
                entry["greedy_seconds"] = run.seconds
                entry["per_prompt"]["greedy_prefix"] = prefix
                entry["per_prompt"]["greedy_tokens"] = mine
                entry["per_prompt"]["engine_first_logprob"] = run.first_logprobs
                # Cross-checks of runtime against reference: the first greedy token is the
                # argmax of the reference's logits at P-1 (up to fp32 near-ties), and its
                # logprob is the reference's (to fp32 rounding; dense's differs where a feature acts).
                entry["engine_first_token_matches_reference"] = float(np.mean(
                    [bool(m) and m[0] == f for m, f in zip(mine, row["first"])]))
                entry["engine_first_logprob_max_abs_diff"] = max(
                    abs(lp - float(logp[m[0]])) for lp, m, logp in zip(run.first_logprobs, mine, row["first_logp"]))
                if run.skipped is not None:
                    total = mcfg.num_loops * length * len(mine)
                    entry["engine_computed_fraction"] = 1.0 - run.skipped / total
            results[c.name][str(length)] = entry

    record = {
        "command": " ".join(["python", "bench/flashloop_quality.py"] + (argv if argv is not None else sys.argv[1:])),
        "model": str(args.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "corpus": corpus,
        "settings": {"lengths": args.lengths, "prompts": args.prompts, "continuation": args.continuation,
                     "greedy_tokens": args.greedy_tokens, "exit_threshold": args.exit_threshold
                     if args.exit_threshold is not None else mcfg.early_exit_threshold,
                     "engine_max_model_len": max_model_len, "engine_cuda_graphs": args.cuda_graphs,
                     "dtype": "float32"},
        "configs": [c.record(max_model_len) for c in configs],
        "prompts": placement,
        "results": results,
        "seconds": time.perf_counter() - START,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print_table(configs, args.lengths, results, greedy is not None)
    print_reconstruction(configs, args.lengths, results)
    off = [(c.name, n) for c in configs for n in args.lengths
           if results[c.name][str(n)].get("engine_first_token_matches_reference", 1.0) < 1.0]
    if off:
        log(f"warning: the engine's first greedy token differs from the reference's argmax for {off}")
    log(f"wrote {args.out}")
    return 0


def print_table(configs: list[Config], lengths: list[int], results: dict[str, dict[str, Any]], greedy: bool) -> None:
    """Per configuration and length: Δloss % (± paired std-err), top-1 agreement with dense,
    mean greedy common prefix with dense; then the computed fraction (mean over lengths)
    and the worst Δloss % over lengths."""
    block = 26
    head = f"{'config':24s}" + "".join(f"| {'L=' + str(n):<{block - 2}s}" for n in lengths) + "| compute  worst"
    sub = f"{'':24s}" + "".join(f"| {'dloss% +-se':13s}{'top1':>6s}{'pfx' if greedy else '':>5s}" for _ in lengths) \
        + "|  frac    dloss%"
    print(head)
    print(sub)
    for c in configs:
        line = f"{c.name:24s}"
        worst = -math.inf
        for n in lengths:
            e = results[c.name][str(n)]
            se = e["delta_loss_pct_paired_stderr"]
            d = f"{e['delta_loss_pct']:+.2f}" + (f"+-{se:.2f}" if se is not None else "")
            pfx = f"{e['greedy_prefix_mean']:5.1f}" if greedy else ""
            line += f"| {d:13s}{e['top1_agree_dense']:6.3f}{pfx:>5s}"
            worst = max(worst, e["delta_loss_pct"])
        comp = float(np.mean([results[c.name][str(n)]["computed_fraction"] for n in lengths]))
        print(line + f"| {comp:5.3f}  {worst:+7.2f}")
    if greedy and any(c.kv_tail is not None for c in configs):
        print("(greedy of the kv-int4 configurations: eager, the default attention backend)")


def print_reconstruction(configs: list[Config], lengths: list[int], results: dict[str, dict[str, Any]]) -> None:
    """Per KV residual configuration, K/V and plane: err_mean / err_max over layers, prompts
    and lengths (err: a layer's max |X^ - X| over the plane's rows), and absmax (mean max |X|)."""
    kv = [c for c in configs if c.kv_tail is not None]
    if not kv:
        return
    planes = sorted(results[kv[0].name][str(lengths[0])]["reconstruction_error"]["k"], key=int)
    print("reconstruction error per plane: err_mean/err_max of absmax")
    print(f"{'':28s}" + "".join(f"| {'plane ' + p:23s}" for p in planes))
    for c in kv:
        for kind in "kv":
            line = f"{c.name:24s} {kind.upper():3s}"
            for plane in planes:
                rows = [results[c.name][str(n)]["reconstruction_error"][kind][plane] for n in lengths]
                mean = float(np.mean([r["err_mean"] for r in rows]))
                worst = max(r["err_max"] for r in rows)
                line += f"| {mean:.4f}/{worst:.4f} of {float(np.mean([r['absmax'] for r in rows])):5.2f} "
            print(line)


if __name__ == "__main__":
    sys.exit(main())
