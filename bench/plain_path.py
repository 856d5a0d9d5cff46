"""Plain-PyTorch Ouro inference: the yardstick the engine's speed is compared against (issue 39).

A looped transformer written again, on its own, in plain PyTorch: one stack of L decoder
layers applied R times (every loop for every token: no early exit, as the engine's
benchmarks run), a static KV cache with one plane per (loop, layer), a prefill through
flash SDPA and a decode step made of one `torch.compile`d layer function (the same one for
every layer and loop) captured whole as one CUDA graph. It reads the checkpoint folder
itself (config.json + safetensors) and shares no code with `specloop.model`, so the
engine's numbers are compared with an independent path over the same weights and dtype.
`check_against_specloop` (and tests/test_plain_path.py) holds it to specloop's own model.

The Ouro math it follows (checked against `specloop.model`):
- embedding -> R loops of [L sandwich-norm layers, then the final norm `model.norm`]; the
  next loop's input is that normed output; logits = lm_head(normed output of loop R);
- layer: h += norm_b(attn(norm_a(h))); h += norm_d(mlp(norm_c(h))) with norms a, b, c, d =
  input_layernorm, input_layernorm_2, post_attention_layernorm, post_attention_layernorm_2;
- RMSNorm: variance in fp32, normalise, cast to the model dtype, then times the weight;
- RoPE rotate-half (pairs i, i + D/2), fp32 angles, the same absolute position at every loop;
- GQA (query head j reads KV head j // (Hq / Hkv)), scale D^-0.5, SwiGLU MLP, no biases,
  untied lm_head; each loop's queries read that loop's keys and values.

Run it on the GPU (device machine; checkout on PYTHONPATH, a random checkpoint first):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/plain_path.py --model /tmp/ouro14 --out bench/results/plain_path_h100.json

Per case "BxP" it prefills B random P-token prompts, then times `--decode-tokens` greedy
steps (no EOS stop) as graph replays with CUDA events, median of `--repeats`: tokens/s =
B x steps / time. `--ttft P` times one P-token prompt to its first sampled token (prefill +
head + argmax, synchronised, wall clock), compiled and eager. Before timing it checks the
timed configuration itself (compiled layer, graph, dtype) against specloop's model on a
short batch (`check_against_specloop`; `--no-check` skips it, `--check-fp32` adds an fp32
copy of the timed path checked to 1e-4; a failed check is printed, recorded and makes the
exit status 1, the timings still run). A compile or capture failure
falls back (no graph, then the eager layer) with a WARNING line and is recorded in the JSON
("errors", "compiled_decode", "graph"). Each (batch, length) shape compiles its own static
graphs (~8 compiles for the defaults); split `--cases` over several calls if 10 minutes
are tight. On CPU: `--device cpu --no-compile` (graphs are CUDA only), times meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch.nn import functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


# ---------------------------------------------------------------------------------------
# Checkpoint: shape and weights


@dataclasses.dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int  # L
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    loops: int  # R
    rope_theta: float
    eps: float


def read_shape(folder: Path) -> Shape:
    """The model's shape from the folder's config.json (Hugging Face Ouro fields)."""
    raw = json.loads((folder / "config.json").read_text())
    if raw.get("rope_scaling") not in (None, {}) or raw.get("use_sliding_window") or raw.get("attention_bias"):
        raise ValueError("plain path: rope scaling, sliding windows and biases are not implemented")
    if raw.get("tie_word_embeddings"):
        raise ValueError("plain path: tied embeddings are not implemented (Ouro unties lm_head)")
    heads = raw["num_attention_heads"]
    return Shape(
        vocab=raw["vocab_size"], hidden=raw["hidden_size"], intermediate=raw["intermediate_size"],
        layers=raw["num_hidden_layers"], heads=heads, kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, loops=raw.get("total_ut_steps", 4),
        rope_theta=float(raw.get("rope_theta", 1e6)), eps=float(raw.get("rms_norm_eps", 1e-6)),
    )


class LayerWeights(NamedTuple):
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q_proj, k_proj, v_proj rows
    o: torch.Tensor  # [H, Hq D]
    gate_up: torch.Tensor  # [2 I, H]: gate_proj rows, then up_proj rows
    down: torch.Tensor  # [H, I]
    norm_a: torch.Tensor  # [H] input_layernorm: attention input
    norm_b: torch.Tensor  # [H] input_layernorm_2: attention output, before the residual add
    norm_c: torch.Tensor  # [H] post_attention_layernorm: MLP input
    norm_d: torch.Tensor  # [H] post_attention_layernorm_2: MLP output, before the residual add


@dataclasses.dataclass
class Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H] model.norm, applied at the end of every loop
    lm_head: torch.Tensor  # [V, H]


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_weights(folder: Path, shape: Shape, device: torch.device, dtype: torch.dtype) -> Weights:
    """Read every tensor by its checkpoint name, cast to `dtype` on `device`; fuse q/k/v and
    gate/up into one matrix each (one matmul instead of three and two)."""
    files = _tensor_files(folder)
    raw: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name).to(device, dtype)

    def take(name: str) -> torch.Tensor:
        return raw.pop(name)

    layers = []
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        layers.append(LayerWeights(
            qkv=qkv, o=take(p + "self_attn.o_proj.weight"), gate_up=gate_up, down=take(p + "mlp.down_proj.weight"),
            norm_a=take(p + "input_layernorm.weight"), norm_b=take(p + "input_layernorm_2.weight"),
            norm_c=take(p + "post_attention_layernorm.weight"), norm_d=take(p + "post_attention_layernorm_2.weight"),
        ))
    weights = Weights(embed=take("model.embed_tokens.weight"), layers=layers, norm=take("model.norm.weight"),
                      lm_head=take("lm_head.weight"))
    unused = sorted(set(raw) - {"model.early_exit_gate.weight", "model.early_exit_gate.bias"})
    if unused:
        raise ValueError(f"plain path: unexpected tensors in the checkpoint: {unused[:3]}")
    return weights


# ---------------------------------------------------------------------------------------
# Model math: module-level functions, so that one compiled layer serves every layer and loop


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H]: variance in fp32 (fp64 for fp64), normalise, cast back, then scale."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def sandwich_add(h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Ouro's residual add: the sub-block's output is normed before it joins the stream."""
    return h + rms_norm(out, weight, eps)


def rope_tables(length: int, head_dim: int, theta: float, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, D] for positions 0..length-1: fp32 angles, halves repeated."""
    acc = torch.promote_types(dtype, torch.float32)
    inv_freq = (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    angles = torch.arange(length, device=device).to(acc)[:, None] * inv_freq.to(device, acc)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [..., heads, D], cos/sin broadcastable [..., 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def swiglu(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


def visible_keys(key_index: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """key_index [Lmax], pos [1] -> [1, 1, 1, Lmax] bool: the keys a token at `pos` reads."""
    return (key_index <= pos).view(1, 1, 1, -1)


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, Hkv, G, D] (G query heads per KV head as G query rows), k/v [B, Hkv, Lmax, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The same as two matmuls and an fp32 softmax (cuBLAS reads the cache, not SDPA)."""
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return probs.to(v.dtype) @ v


ATTENTION = {"sdpa": attend_sdpa, "matmul": attend_matmul}


def decode_layer(
    h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, k_plane: torch.Tensor,
    v_plane: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor, eps: float, attend: Callable,
) -> torch.Tensor:
    """One layer, one new token per sequence, all shapes static (capturable).

    h [B, H]; cos/sin [1, 1, D] at `pos`; k_plane/v_plane [B, Hkv, Lmax, D], this (loop,
    layer)'s cache, written here at `pos` [1] (long, on device); visible [1, 1, 1, Lmax].
    Returns h [B, H].
    """
    b = h.shape[0]
    hkv, d = k_plane.shape[1], k_plane.shape[3]
    hq = w.o.shape[1] // d
    q, k, v = F.linear(rms_norm(h, w.norm_a, eps), w.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rotate(q.view(b, hq, d), cos, sin)  # [B, Hq, D]
    k = rotate(k.view(b, hkv, d), cos, sin)  # [B, Hkv, D]
    k_plane.index_copy_(2, pos, k.view(b, hkv, 1, d))
    v_plane.index_copy_(2, pos, v.reshape(b, hkv, 1, d))
    o = attend(q.view(b, hkv, hq // hkv, d), k_plane, v_plane, visible)  # [B, Hkv, G, D]
    h = sandwich_add(h, F.linear(o.reshape(b, hq * d), w.o), w.norm_b, eps)
    return sandwich_add(h, swiglu(rms_norm(h, w.norm_c, eps), w), w.norm_d, eps)


def prefill_layer(
    h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, k_plane: torch.Tensor,
    v_plane: torch.Tensor, eps: float,
) -> torch.Tensor:
    """One layer over whole prompts at positions 0..T-1, causal flash SDPA.

    h [B, T, H]; cos/sin [T, 1, D]; writes k_plane/v_plane [B, Hkv, Lmax, D] at [:T].
    Returns h [B, T, H].
    """
    b, t, _ = h.shape
    hkv, d = k_plane.shape[1], k_plane.shape[3]
    hq = w.o.shape[1] // d
    q, k, v = F.linear(rms_norm(h, w.norm_a, eps), w.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rotate(q.view(b, t, hq, d), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
    k = rotate(k.view(b, t, hkv, d), cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.reshape(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    k_plane[:, :, :t].copy_(k)
    v_plane[:, :, :t].copy_(v)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)  # [B, Hq, T, D]
    h = sandwich_add(h, F.linear(o.transpose(1, 2).reshape(b, t, hq * d), w.o), w.norm_b, eps)
    return sandwich_add(h, swiglu(rms_norm(h, w.norm_c, eps), w), w.norm_d, eps)


# ---------------------------------------------------------------------------------------
# The model: static cache, prefill, decode


@dataclasses.dataclass
class StaticCache:
    """K/V of every (loop, layer) plane, preallocated: k, v [R, L, B, Hkv, Lmax, D].

    Filled with random values, so a wrong mask (reading a slot not yet written) shows."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor  # [Lmax, D]
    sin: torch.Tensor  # [Lmax, D]
    key_index: torch.Tensor  # [Lmax] long: 0..Lmax-1

    @property
    def max_len(self) -> int:
        return self.k.shape[4]

    def plane(self, loop: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[loop, layer], self.v[loop, layer]


def _compile(fn: Callable) -> Callable:
    """`fn` under torch.compile, static shapes, one graph; the recompile limit raised so
    each (batch, length) case gets its own static graph."""
    import torch._dynamo.config as dynamo_config

    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(64, getattr(dynamo_config, limit)))
    return torch.compile(fn, fullgraph=True, dynamic=False)


class PlainOuro:
    """The whole model over static caches. `decode_fn`/`prefill_fn` are the per-layer
    functions, the same for every layer and loop: compiled ones (kept in `compiled_decode`
    and `compiled_prefill`) or the eager ones."""

    def __init__(self, shape: Shape, weights: Weights, compile: bool = False, attention: str = "sdpa") -> None:
        self.shape = shape
        self.w = weights
        self.attend = ATTENTION[attention]
        self.compiled_decode = _compile(decode_layer) if compile else None
        self.compiled_prefill = _compile(prefill_layer) if compile else None
        self.decode_fn: Callable = self.compiled_decode or decode_layer
        self.prefill_fn: Callable = self.compiled_prefill or prefill_layer

    @classmethod
    def from_checkpoint(cls, folder: str | Path, device: str | torch.device, dtype: torch.dtype,
                        compile: bool = False, attention: str = "sdpa") -> PlainOuro:
        folder = Path(folder)
        shape = read_shape(folder)
        return cls(shape, load_weights(folder, shape, torch.device(device), dtype), compile, attention)

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def new_cache(self, batch: int, max_len: int, seed: int = 0) -> StaticCache:
        s = self.shape
        size = (s.loops, s.layers, batch, s.kv_heads, max_len, s.head_dim)
        gen = torch.Generator(self.device).manual_seed(seed)
        k = torch.empty(size, dtype=self.dtype, device=self.device).normal_(generator=gen)
        v = torch.empty(size, dtype=self.dtype, device=self.device).normal_(generator=gen)
        cos, sin = rope_tables(max_len, s.head_dim, s.rope_theta, self.dtype, self.device)
        return StaticCache(k, v, cos, sin, torch.arange(max_len, device=self.device))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """End-of-loop hidden [B, H] -> logits [B, V], fp32 (fp64 for an fp64 model)."""
        return F.linear(h, self.w.lm_head).to(torch.promote_types(self.dtype, torch.float32))

    def prefill(self, tokens: torch.Tensor, cache: StaticCache, eager: bool = False) -> torch.Tensor:
        """tokens [B, T] (positions 0..T-1) -> last position's logits [B, V]; fills cache [:T]."""
        t = tokens.shape[1]
        layer = prefill_layer if eager else self.prefill_fn
        cos, sin = cache.cos[:t, None, :], cache.sin[:t, None, :]  # [T, 1, D]
        h = F.embedding(tokens, self.w.embed)  # [B, T, H]
        for loop in range(self.shape.loops):
            for i, w in enumerate(self.w.layers):
                h = layer(h, w, cos, sin, *cache.plane(loop, i), self.shape.eps)
            h = rms_norm(h, self.w.norm, self.shape.eps)  # the end-of-loop norm
        return self.head(h[:, -1])

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """tokens [B] at position pos [1] (long, on device) -> logits [B, V]; writes the cache
        at pos. No host sync and no shape that depends on pos: capturable."""
        cos = cache.cos.index_select(0, pos).unsqueeze(0)  # [1, 1, D]
        sin = cache.sin.index_select(0, pos).unsqueeze(0)
        visible = visible_keys(cache.key_index, pos)  # [1, 1, 1, Lmax]
        h = F.embedding(tokens, self.w.embed)  # [B, H]
        for loop in range(self.shape.loops):
            for i, w in enumerate(self.w.layers):
                h = self.decode_fn(h, w, cos, sin, *cache.plane(loop, i), pos, visible, self.shape.eps, self.attend)
            h = rms_norm(h, self.w.norm, self.shape.eps)
        return self.head(h)


class DecodeStep:
    """Greedy decoding over static buffers, one token per sequence per call.

    A call feeds `tokens` [B] at `pos` [1], leaves the logits in `logits` [B, V], the greedy
    next tokens in `tokens` and pos + 1 in `pos`: all on the device, no host sync, so calls
    chain. After `capture()` a call is one CUDA graph replay."""

    def __init__(self, model: PlainOuro, cache: StaticCache) -> None:
        self.model = model
        self.cache = cache
        batch = cache.k.shape[2]
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=model.device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def start(self, tokens: torch.Tensor, pos: int) -> None:
        """Feed `tokens` [B] at position `pos` on the next call."""
        self.tokens.copy_(tokens)
        self.pos.fill_(pos)

    def _step(self) -> torch.Tensor:
        logits = self.model.decode(self.tokens, self.pos, self.cache)
        self.tokens.copy_(logits.argmax(dim=-1))
        self.pos.add_(1)
        return logits

    def warm_up(self, steps: int = 3) -> None:
        """Run `steps` steps from the current tokens and pos (compiling, autotuning and
        allocating), then put tokens and pos back. What they wrote in the cache at pos and
        after is rewritten by the real steps before any read (later keys are masked)."""
        tokens, pos = self.tokens.clone(), self.pos.clone()
        for _ in range(steps):
            self._step()
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)

    def capture(self, warmup: int = 3) -> None:
        """Warm up on a side stream, then capture one step as a CUDA graph (which runs
        nothing: tokens and pos stay as they were)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.warm_up(warmup)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._step()
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._step()


# ---------------------------------------------------------------------------------------
# Correctness against specloop's model


BF16_EXCESS = 1.25  # low precision: the plain path's error may exceed specloop's by 25% (+1e-3)


def check_against_specloop(
    folder: str | Path, batch: int = 2, prompt_len: int = 12, steps: int = 4,
    device: str = "cpu", dtype: torch.dtype = torch.float32, model: PlainOuro | None = None,
    graph: bool = False, seed: int = 0, tolerance: float = 1e-4,
) -> dict:
    """Prefill and `steps` greedy decode steps of the plain path against specloop's
    `OuroModel` run with every loop over the whole sequence (`specloop.training.forward.
    batched_loops` at exit threshold 1.0: the engine's own layer code).

    Errors are per position ||got - want|| / ||want|| of the [B, V] logits: position P-1
    from the prefill, then one per decode step (the plain path's greedy tokens are fed to
    both). fp32/fp64: `ok` when each is under `tolerance` against specloop in that dtype.
    bf16/fp16, where two orders of rounding drift apart over R x L layers (5.6e-2 between
    the two in bf16 on random ouro-1.4b weights, CPU): both are measured against specloop
    in fp32 (there 0.147 and 0.145), and `ok` when the plain path's error is at most
    `BF16_EXCESS` x specloop's own (+1e-3): a decode mask that misses the token's own key
    came out at 0.22 there, 1.5x. fp32 is the strict check (`--check-fp32` on the GPU).
    `model` checks the caller's (compiled) instance; `graph` captures the decode step.
    """
    plain = model or PlainOuro.from_checkpoint(folder, device, dtype)
    dtype = plain.dtype  # a given model's own
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, plain.shape.vocab, (batch, prompt_len), generator=gen).to(plain.device)
    got, sequence = _plain_greedy(plain, prompts, steps, graph)
    exact = dtype in (torch.float32, torch.float64)
    want = _specloop_logits(folder, sequence, prompt_len, dtype if exact else torch.float32, plain.device)
    result = {"batch": batch, "prompt_len": prompt_len, "steps": steps, "dtype": str(dtype).removeprefix("torch."),
              "rel_errors": _rel_errors(got, want),
              "greedy_agreement": float((got.argmax(-1) == want.argmax(-1)).double().mean())}
    result["max_rel_error"] = max(result["rel_errors"])
    if exact:
        result["ok"] = result["max_rel_error"] <= tolerance
        result["tolerance"] = tolerance
    else:
        own = _rel_errors(_specloop_logits(folder, sequence, prompt_len, dtype, plain.device), want)
        result["specloop_rel_errors"] = own
        result["ok"] = all(e <= BF16_EXCESS * o + 1e-3 for e, o in zip(result["rel_errors"], own))
    return result


@torch.no_grad()
def _plain_greedy(plain: PlainOuro, prompts: torch.Tensor, steps: int,
                  graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts [B, P] -> logits [B, steps + 1, V] (fp64) of the prefill and each decode step,
    and the sequence [B, P + steps] of prompt and fed tokens."""
    batch, prompt_len = prompts.shape
    cache = plain.new_cache(batch, _cache_len(prompt_len, steps), seed=1)
    got = [plain.prefill(prompts, cache)]
    step = DecodeStep(plain, cache)
    step.start(got[0].argmax(dim=-1), prompt_len)
    step.capture() if graph else step.warm_up()
    fed = []
    for _ in range(steps):
        fed.append(step.tokens.clone())
        step()
        got.append(step.logits.clone())
    return torch.stack(got, dim=1).double(), torch.cat([prompts, *(t[:, None] for t in fed)], dim=1)


@torch.no_grad()
def _specloop_logits(folder: str | Path, sequence: torch.Tensor, prompt_len: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """specloop's logits [B, T - P + 1, V] (fp64) at positions P-1..T-1 of sequence [B, T]."""
    from specloop.checkpoint import load_model
    from specloop.training.forward import batched_loops

    ref, _ = load_model(folder, dtype=dtype, device=device)
    out = batched_loops(ref, sequence, exit_threshold=1.0)
    return ref.head(out.hidden[-1][:, prompt_len - 1:]).double()


def _rel_errors(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """Per position (dim 1): ||got - want|| / ||want||."""
    return [float((got[:, i] - want[:, i]).norm() / want[:, i].norm()) for i in range(want.shape[1])]


# ---------------------------------------------------------------------------------------
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_decode(step: DecodeStep, first: torch.Tensor, pos: int, steps: int) -> float:
    """ms for `steps` chained decode steps from `pos` (CUDA events on the GPU)."""
    device = step.tokens.device
    step.start(first, pos)
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3


def time_to_first_token(model: PlainOuro, prompt: torch.Tensor, cache: StaticCache, eager: bool) -> float:
    """ms from a prompt [1, P] on the device to its greedy first token on the host."""
    _sync(model.device)
    t0 = time.perf_counter()
    token = int(model.prefill(prompt, cache, eager=eager).argmax(dim=-1)[0])
    elapsed = (time.perf_counter() - t0) * 1e3
    assert 0 <= token < model.shape.vocab
    return elapsed


def _stack_bytes(model: PlainOuro) -> int:
    """Bytes of weights one decode step reads: R x the layer stack + lm_head."""
    layer = sum(t.numel() * t.element_size() for t in model.w.layers[0])
    head = model.w.lm_head.numel() * model.w.lm_head.element_size()
    return model.shape.loops * model.shape.layers * layer + head


def _cache_len(prompt_len: int, steps: int) -> int:
    """Lmax: the prompt, the timed steps and the capture's warm-up, rounded up to 64."""
    return -(-(prompt_len + steps + 4) // 64) * 64


def _prepare_step(model: PlainOuro, cache: StaticCache, first: torch.Tensor, pos: int, use_graph: bool,
                  log: dict) -> DecodeStep:
    """A warmed-up step that feeds `first` [B] at `pos` next: compiled layer and CUDA graph
    where asked. A failure falls back, in order, to no graph, then the eager layer (with the
    graph again, then without), loudly, and what ran is recorded in `log`."""
    compiled = model.compiled_decode is not None and model.decode_fn is model.compiled_decode
    tries = [(c, g) for c in (compiled, False) for g in (use_graph, False)]
    for layer_compiled, graph in dict.fromkeys(tries):  # in order, without repeats
        model.decode_fn = model.compiled_decode if layer_compiled else decode_layer
        step = DecodeStep(model, cache)
        step.start(first, pos)
        try:
            step.capture() if graph else step.warm_up()
        except Exception as exc:  # noqa: BLE001 - reported and recorded, then the next try
            what = f"decode step (compiled={layer_compiled}, graph={graph})"
            print(f"WARNING: {what} failed: {type(exc).__name__}: {exc}", flush=True)
            log.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: {exc}")
            _sync(model.device)
            continue
        log["compiled_decode"], log["graph"] = layer_compiled, graph
        return step
    raise RuntimeError("plain path: the decode step fails even eager and without a graph (see above)")


def _prefill(model: PlainOuro, prompts: torch.Tensor, cache: StaticCache, log: dict) -> torch.Tensor:
    """`model.prefill`; if the compiled layer fails, say so, record it and go on eager."""
    try:
        return model.prefill(prompts, cache)
    except Exception as exc:  # noqa: BLE001 - reported and recorded, then eager
        if model.prefill_fn is prefill_layer:
            raise
        print(f"WARNING: compiled prefill failed ({type(exc).__name__}: {exc}); eager from now on", flush=True)
        log.setdefault("errors", []).append(f"compiled prefill: {type(exc).__name__}: {exc}")
        model.prefill_fn = model.compiled_prefill = prefill_layer
        _sync(model.device)
        return model.prefill(prompts, cache)


def run_case(model: PlainOuro, batch: int, prompt_len: int, steps: int, repeats: int,
             use_graph: bool, seed: int, log: dict) -> dict:
    """Decode tokens/s of `batch` sequences after a `prompt_len`-token prompt."""
    device = model.device
    max_len = _cache_len(prompt_len, steps)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, model.shape.vocab, (batch, prompt_len), generator=gen).to(device)
    cache = model.new_cache(batch, max_len, seed)
    t0 = time.perf_counter()
    first = _prefill(model, prompts, cache, log).argmax(dim=-1)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    step = _prepare_step(model, cache, first, prompt_len, use_graph, log)
    times = [time_decode(step, first, prompt_len, steps) for _ in range(repeats + 1)][1:]  # first: warm-up
    ms = statistics.median(times)
    kv_bytes = cache.k.numel() * cache.k.element_size() * 2  # every plane read whole (masked)
    result = {
        "batch": batch, "prompt_len": prompt_len, "decode_tokens": steps, "max_len": max_len,
        "tok_s": batch * steps / (ms / 1e3), "ms_per_step": ms / steps, "repeats_ms": times,
        "bytes_per_step": _stack_bytes(model) + kv_bytes,
        "achieved_gb_s": (_stack_bytes(model) + kv_bytes) / (ms / steps / 1e3) / 1e9,
        "first_prefill_s": prefill_s, "graph": step.graph is not None,
        "sample_tokens": step.tokens[: min(batch, 4)].tolist(),
    }
    del step, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_ttft(model: PlainOuro, prompt_len: int, steps: int, repeats: int, seed: int) -> dict:
    """Time to first token of one prompt, with the compiled layer and eager. The cache has
    the length of a decode case's (`steps` after the prompt), whose compiled prefill it reuses."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.shape.vocab, (1, prompt_len), generator=gen).to(model.device)
    cache = model.new_cache(1, _cache_len(prompt_len, steps), seed)
    result: dict = {"prompt_len": prompt_len}
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for name, eager in (("compiled", False), ("eager", True)):
        if name == "compiled" and model.compiled_prefill is None:
            continue
        try:
            time_to_first_token(model, prompt, cache, eager)  # warm-up (compiles)
        except Exception as exc:  # noqa: BLE001 - reported and recorded
            print(f"WARNING: {name} prefill failed ({type(exc).__name__}: {exc})", flush=True)
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            continue
        times = [time_to_first_token(model, prompt, cache, eager) for _ in range(repeats)]
        result[f"{name}_ms"] = statistics.median(times)
        result[f"{name}_repeats_ms"] = times
    if model.device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del cache
    return result


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _run_check(folder: str, model: PlainOuro, graph: bool, seed: int) -> dict:
    """`check_against_specloop` of this instance as it will be timed; a failure or an error
    is printed and recorded, never raised (a broken check must not cost the timings)."""
    t0 = time.perf_counter()
    try:
        result = check_against_specloop(folder, device=str(model.device), dtype=model.dtype, model=model,
                                        graph=graph, seed=seed)
    except Exception as exc:  # noqa: BLE001 - recorded, see above
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(f"check against specloop ({time.perf_counter() - t0:.1f} s): {result}", flush=True)
    if not result["ok"]:
        print("WARNING: the plain path does NOT match specloop's model; numbers below are suspect", flush=True)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--cases", default="1x1024,32x1024,1x8192", help="comma-separated BATCHxPROMPT")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--ttft", type=int, default=8192, help="prompt length of the TTFT case (0: none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="JSON file for the results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention", choices=sorted(ATTENTION), default="sdpa", help="decode attention")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the check against specloop's model")
    p.add_argument("--check-fp32", action="store_true",
                   help="also check an fp32 copy of the timed path (compiled, graph) to 1e-4")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    use_graph = device.type == "cuda" and not args.no_graph
    compile = not args.no_compile
    cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",") if c]
    log: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "git_commit": _git_commit(), "dtype": args.dtype or str(dtype)[6:],
        "compile": compile, "compiled_decode": compile, "graph": use_graph, "attention": args.attention,
        "model": args.model, "cases": [], "ttft": None,
    }
    print(f"plain path: {log['device_name']}, torch {torch.__version__}, {log['dtype']}, compile={compile}, "
          f"graph={use_graph}, attention={args.attention}", flush=True)
    t0 = time.perf_counter()
    model = PlainOuro.from_checkpoint(args.model, device, dtype, compile, args.attention)
    log["shape"] = dataclasses.asdict(model.shape)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s: {model.shape}", flush=True)

    with torch.no_grad():
        if not args.no_check:
            log["check"] = _run_check(args.model, model, use_graph, args.seed)
        if args.check_fp32:  # the same compiled layer and graph in fp32, to 1e-4
            strict = PlainOuro.from_checkpoint(args.model, device, torch.float32, compile, args.attention)
            log["check_fp32"] = _run_check(args.model, strict, use_graph, args.seed)
            del strict
        for batch, prompt_len in cases:
            t0 = time.perf_counter()
            result = run_case(model, batch, prompt_len, args.decode_tokens, args.repeats, use_graph, args.seed, log)
            log["cases"].append(result)
            print(f"{batch}x{prompt_len}: {result['tok_s']:.1f} tok/s, {result['ms_per_step']:.3f} ms/step "
                  f"({time.perf_counter() - t0:.1f} s incl. prefill and compile)", flush=True)
        if args.ttft:
            log["ttft"] = run_ttft(model, args.ttft, args.decode_tokens, args.repeats, args.seed)
            print(f"ttft {args.ttft}: {log['ttft']}", flush=True)

    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(log, indent=2) + "\n")
    print(f"\n{'case':>10} {'tok/s':>10} {'ms/step':>9} {'GB/s':>7}")
    for c in log["cases"]:
        case = f"{c['batch']}x{c['prompt_len']}"
        print(f"{case:>10} {c['tok_s']:>10.1f} {c['ms_per_step']:>9.3f} {c['achieved_gb_s']:>7.0f}")
    if log["ttft"]:
        t = log["ttft"]
        print(f"ttft {t['prompt_len']}: compiled {t.get('compiled_ms', float('nan')):.1f} ms, "
              f"eager {t.get('eager_ms', float('nan')):.1f} ms")
    checks_ok = all(log[name]["ok"] for name in ("check", "check_fp32") if name in log)
    return 0 if checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
