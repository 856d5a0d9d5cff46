"""Readable FlashLoop reference: the dense reference plus the three FlashLoop features.

Like `specloop.model.reference`, this recomputes every loop over the whole sequence
(loop outer, layers inner, all positions at once; causality makes that equal to serial
decoding), reads weights by checkpoint names and runs attention softmax in fp32 (fp64 for
fp64 weights). It is the oracle for the FlashLoop runtime, so it shares no code with
`specloop.model.ouro`, `specloop.model.layers`, `specloop.runtime` or the kernels: the
norm, rotation and attention are written out again here (not imported from
`reference.py` either), and only the exit-gate arithmetic (`specloop.model.exit_gate`) is
shared, as in the dense reference. Positions 0..prompt_len-1 are the prompt; later
positions are generated tokens (decode queries). Each loop gathers the rows that run it
and computes only those, at their absolute positions (RoPE and the causal mask), against
every token's stored K/V; rows that do not run are not computed at all.

Features (all off = the dense reference; loops are 1-based, as in the RFC):

Token-sparse prefill (RFC 3.1). Loops 1 and 2 are dense. Before loop r >= 3, inside each
selection window, the eligible tokens (active at r-1, not exited) are ranked by
score = ||H[r-1] - H[r-2]|| / max(||H[r-1]||, eps) (fp32, end-of-loop states) and the
top `prefill_budget(window length, retention[r-1])` run loop r; ties go to the lower
absolute position. No slot is reserved for any token. Inactive prompt tokens keep their
end-of-loop state and every layer's K/V from the last loop they ran, skip the exit gate,
and their logits come from that state. Generated tokens are never selected out.

Sparse decode attention (RFC 3.2), generated-token queries only. At loop 2, per layer,
query and query head, keep S = the top `decode_budget(q + 1, key_retention)` keys of the
loop-2 probabilities P (ties to the lower position), m = sum_S P, O_ref = the full loop-2
output and C_ref = sum_S P V2 (not renormalised). At loops >= 3:
O = O_ref - C_ref + m * softmax(q_r . K_r[S] / sqrt(D)) @ V_r[S].

KV residuals (RFC 3.3) as fake quantization. Per layer, for X in {K after RoPE, V}:
X^1 = D(Q(X1)); at r >= 2 only tokens that computed K/V at loop r have a residual row:
X^r = X^(r-1) + D(Q(Xr - X^(r-1))); the others inherit X^(r-1) (absent is not code 0).
Affine groups (`quantize`): scale and min rounded to fp16 first, codes computed with the
rounded values in fp32, round half to even, clamp to [0, 2^bits - 1]. A constant group
(every element equal) stores scale 1 and codes 0 and decodes to its fp16 minimum: exactly
its value whenever fp16 holds it (0 -- residuals of values a loop left unchanged -- and
every bf16 value with 2^-14 <= |x| <= 65504), rounded to fp16 like every group's minimum
otherwise (the RFC's FP16 parameters: a packed format stores no wider value; -0.0 decodes
as +0.0). K groups are per channel
over `group_size` consecutive rows of a plane (plane 1: all tokens; plane r >= 2: the
compact rows, i.e. the tokens with a residual row, in position order); V groups are per
row over `group_size` consecutive channels of one head. Short groups take statistics over
their valid elements only.

Serial visibility (what a query reads depends only on its own position q). A row group
of plane 1 seals at last_pos + tail (last_pos: absolute position of its last row); a row
group of plane r >= 2 seals at max(last_pos + tail, the seal positions of its rows'
depth-(r-1) values), because its residuals are taken against reconstructions that exist
only once those predecessors are encoded (this keeps the rule causal); a group with fewer
than `group_size` rows never seals. A token's depth-d K and V are read reconstructed by a
query at q iff q >= the seal position of the group holding its deepest row at a plane
<= d (see `seal_positions`); otherwise the query reads the exact values. With
tail = group_size = 64, plane 1 keeps the 64..127 most recent tokens exact.

Ceilings of budgets use exact arithmetic on the decimal a ratio prints as
(`Fraction(repr(x))`): ceil(100 * 0.07) is 7, whereas in floats 100 * 0.07 = 7.000000000000001.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from fractions import Fraction

import torch
from torch.nn import functional as F

from specloop.config import ModelConfig
from specloop.errors import ConfigError
from specloop.model.exit_gate import exit_lambda, exit_step

NEVER = torch.iinfo(torch.long).max
"""Seal position of storage that no query reads reconstructed (a short group)."""


# --- features -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SparsePrefill:
    """window: None = global selection over the whole prompt; an int W = fixed windows
    [k*W, (k+1)*W) of absolute prompt positions (the last may be shorter).
    retention: per 0-based loop, the fraction of each window that runs that loop.
    keep_last: the prompt's last token, when eligible, is always selected (ranked first)."""

    window: int | None = None
    retention: tuple[float, ...] = (1.0, 1.0, 0.25, 0.10)
    eps: float = 1e-6
    keep_last: bool = False

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ConfigError(f"sparse prefill window must be a positive integer or None, got {self.window!r}")
        ret = tuple(self.retention)
        if len(ret) < 2 or ret[0] != 1.0 or ret[1] != 1.0:
            raise ConfigError(f"sparse prefill retention must start with 1.0, 1.0 (loops 1-2 dense), got {ret}")
        if not all(0.0 < r <= 1.0 for r in ret):
            raise ConfigError(f"sparse prefill retention values must lie in (0, 1], got {ret}")
        if any(b > a for a, b in zip(ret, ret[1:])):
            raise ConfigError(f"sparse prefill retention must be non-increasing (nested sets), got {ret}")
        if not self.eps > 0:
            raise ConfigError(f"sparse prefill eps must be positive, got {self.eps}")


@dataclasses.dataclass(frozen=True)
class SparseDecode:
    """Fraction of causal keys each generated query keeps per head at loops >= 3; loop 2 is
    the reference (fixed by the RFC, not an option)."""

    key_retention: float = 0.10

    def __post_init__(self) -> None:
        if not 0.0 < self.key_retention <= 1.0:
            raise ConfigError(f"sparse decode key_retention must lie in (0, 1], got {self.key_retention}")


@dataclasses.dataclass(frozen=True)
class KVResidual:
    """Affine `bits`-bit groups of `group_size`; `tail`: how far past a group's last row a
    query must be before it reads the group reconstructed. `policy` "serial": a group seals
    at that position (or its predecessor's seal); "execution": at the next safe point on
    or after it, the safe points being a one-request run's pass starts: the prompt's chunk
    starts 0, `chunk`, 2 `chunk`, ... (every plane takes its prompt `chunk` positions a pass)
    and every later position (decoding, one a pass)."""

    bits: int = 4
    group_size: int = 64
    tail: int = 64
    policy: str = "serial"
    chunk: int = 2048  # the execution policy's prompt chunk

    def safe_point(self, position: int, prompt_len: int) -> int:
        """The first position >= `position` where a group can seal (NEVER stays NEVER)."""
        if self.policy == "serial" or position >= prompt_len or position >= NEVER:
            return position
        return min(-(-position // self.chunk) * self.chunk, prompt_len)

    def __post_init__(self) -> None:
        if self.policy not in ("serial", "execution"):
            raise ConfigError(f"KV residual policy must be serial or execution, got {self.policy!r}")
        if self.chunk < 1:
            raise ConfigError(f"KV residual chunk must be positive, got {self.chunk}")
        if not 1 <= self.bits <= 8:
            raise ConfigError(f"KV residual bits must lie in 1..8, got {self.bits}")
        if self.group_size < 1:
            raise ConfigError(f"KV residual group_size must be positive, got {self.group_size}")
        if self.tail < 0:
            raise ConfigError(f"KV residual tail must be non-negative, got {self.tail}")


@dataclasses.dataclass(frozen=True)
class FlashLoopFeatures:
    """The three independent feature groups; None switches a feature off."""

    token_sparse_prefill: SparsePrefill | None = None
    sparse_decode: SparseDecode | None = None
    kv_residual: KVResidual | None = None


DENSE = FlashLoopFeatures()


# --- outputs --------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeReference:
    """Loop-2 statistics of one generated query at one layer, per query head.
    keys [Hq, b] selected positions in rank order (highest probability first);
    mass [Hq] = sum of P on them; o_ref / c_ref [Hq, D] full output / weighted part on S."""

    keys: torch.Tensor
    mass: torch.Tensor
    o_ref: torch.Tensor
    c_ref: torch.Tensor


@dataclasses.dataclass
class FlashLoopAudit:
    """What the features decided, for tests and runtime comparisons.

    windows: the selection windows as (start, end) absolute prompt positions.
    prefill_active: {(loop, window index): sorted positions that ran} for every loop >= 3
      whose retention is below 1 (retention 1.0 does no selection and records nothing).
    decode: {(query position, layer): DecodeReference} for generated queries at loop 2.
    reconstruction_error: {(layer, plane, "k" | "v"): max |X^ - X|} over the rows stored
      at that plane (layer 0-based, plane = loop, 1-based).
    loop_keys / loop_values: [R, L, T, Hkv, D] exact K (after RoPE) / V each token holds
      at each depth (inherited where it did not run).
    loop_keys_hat / loop_values_hat: the same reconstructed (KV residuals only).
    seal: [R, T] seal position of each token's depth-r storage (KV residuals only).
    """

    windows: list[tuple[int, int]]
    prefill_active: dict[tuple[int, int], torch.Tensor]
    decode: dict[tuple[int, int], DecodeReference]
    reconstruction_error: dict[tuple[int, int, str], float]
    loop_keys: torch.Tensor
    loop_values: torch.Tensor
    loop_keys_hat: torch.Tensor | None
    loop_values_hat: torch.Tensor | None
    seal: torch.Tensor | None


@dataclasses.dataclass
class FlashLoopOutput:
    """logits [T, V] fp32 (fp64 for fp64 weights) from each token's final state;
    loop_hidden [R, T, H] end-of-loop states (inherited where a token did not run);
    exit_loops [T] 1-based gate exit loop (R when the gate never fired early);
    last_loops [T] the last loop each token ran (its final state);
    active [R, T] which positions ran each loop."""

    logits: torch.Tensor
    loop_hidden: torch.Tensor
    exit_loops: torch.Tensor
    last_loops: torch.Tensor
    active: torch.Tensor
    audit: FlashLoopAudit


# --- token-sparse prefill pieces ------------------------------------------------------

def _exact_ceil(n: int, ratio: float) -> int:
    """ceil(n * ratio) with ratio read as the decimal it prints as (no float rounding)."""
    return math.ceil(n * Fraction(repr(float(ratio))))


def window_bounds(prompt_len: int, window: int | None) -> list[tuple[int, int]]:
    """Selection windows as (start, end) absolute positions; None = one global window."""
    if prompt_len <= 0:
        return []
    if window is None:
        return [(0, prompt_len)]
    return [(s, min(s + window, prompt_len)) for s in range(0, prompt_len, window)]


def prefill_budget(length: int, retention: float) -> int:
    """Tokens of a window of `length` that run a loop: max(1, ceil(length * retention))."""
    return max(1, _exact_ceil(length, retention))


def decode_budget(n: int, key_retention: float) -> int:
    """Keys a decode query with n causal keys keeps: min(n, max(1, ceil(key_retention * n)))."""
    return min(n, max(1, _exact_ceil(n, key_retention)))


def change_score(h_prev: torch.Tensor, h_prev2: torch.Tensor, eps: float) -> torch.Tensor:
    """||h_prev - h_prev2|| / max(||h_prev||, eps) per row, fp32; [N, H] x2 -> [N]."""
    a, b = h_prev.float(), h_prev2.float()
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(eps)


def top_positions(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, ranked; equal values go to the
    lower index first (a stable sort), so the choice never depends on batching."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_active(scores: torch.Tensor, eligible: torch.Tensor, budget: int) -> torch.Tensor:
    """The min(budget, |eligible|) eligible indices of highest score, sorted ascending."""
    candidates = eligible.nonzero().flatten()
    ranked = top_positions(scores[candidates], min(budget, candidates.numel()))
    return candidates[ranked].sort().values


# --- sparse decode pieces -------------------------------------------------------------

def decode_reference(probs: torch.Tensor, values: torch.Tensor, budget: int) -> DecodeReference:
    """Reference statistics from full probabilities probs [Hq, n] and values [Hq, n, D]."""
    keys = top_positions(probs, budget)  # [Hq, b]
    p_sel = probs.gather(-1, keys)
    v_sel = values.gather(1, keys[..., None].expand(-1, -1, values.shape[-1]))
    return DecodeReference(
        keys=keys,
        mass=p_sel.sum(-1),
        o_ref=torch.einsum("hn,hnd->hd", probs, values),
        c_ref=torch.einsum("hb,hbd->hd", p_sel, v_sel),
    )


def corrected_attention(o_ref: torch.Tensor, c_ref: torch.Tensor, mass: torch.Tensor,
                        scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """O_ref - C_ref + m * softmax(scores) @ values; scores [..., b] are q.K/sqrt(D) on S,
    values [..., b, D]; o_ref / c_ref [..., D]; mass [...]."""
    local = scores.softmax(-1)
    return o_ref - c_ref + mass[..., None] * torch.einsum("...b,...bd->...d", local, values)


# --- KV residual pieces ---------------------------------------------------------------

@dataclasses.dataclass
class QuantizedGroups:
    """Affine groups along one dim (kept as size 1 in lo / scale / constant).
    codes: uint8 like x; scale, lo: fp16 (lo the rounded minimum); constant: every element
    of the group equal (scale 1, codes 0); dtype: x's dtype."""

    codes: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    constant: torch.Tensor
    dtype: torch.dtype


def quantize(x: torch.Tensor, dim: int, bits: int) -> QuantizedGroups:
    """Quantize each slice of x along `dim` as one group (every element valid)."""
    levels = 2**bits - 1
    x32 = x.float()
    lo, hi = x32.amin(dim, keepdim=True), x32.amax(dim, keepdim=True)
    constant = (x == x.amin(dim, keepdim=True)).all(dim, keepdim=True)  # in x's own dtype
    lo16 = lo.half()
    # The smallest fp16 subnormal keeps a group whose spread underflows fp16 from dividing by 0.
    # Divided by a tensor: CUDA torch turns division by a Python number into a product with
    # its fp32 reciprocal, which now and then rounds differently from an IEEE division.
    scale16 = ((hi - lo) / torch.tensor(float(levels), device=x.device)).half().clamp_min(2.0**-24)
    scale16 = torch.where(constant, torch.ones_like(scale16), scale16)
    codes = ((x32 - lo16.float()) / scale16.float()).round().clamp(0, levels)  # half to even
    codes = torch.where(constant, torch.zeros_like(codes), codes).to(torch.uint8)
    return QuantizedGroups(codes, lo16, scale16, constant, x.dtype)


def dequantize(groups: QuantizedGroups) -> torch.Tensor:
    """lo + scale * code in fp32, rounded once to the original dtype (a constant group: lo)."""
    return (groups.lo.float() + groups.scale.float() * groups.codes.float()).to(groups.dtype)


def fake_quantize_group(x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """D(Q(x)) with all of x as one group."""
    return dequantize(quantize(x.reshape(-1), 0, bits)).reshape(x.shape)


def quantize_rows(x: torch.Tensor, kind: str, bits: int, group_size: int) -> torch.Tensor:
    """D(Q(plane)) for a plane x [N, Hkv, D] of rows in position order.
    kind "k": per channel over group_size consecutive rows; "v": per row over group_size
    consecutive channels of a head. The last group along that axis may be short."""
    out = torch.empty_like(x)
    if kind == "k":
        for s in range(0, x.shape[0], group_size):
            out[s:s + group_size] = dequantize(quantize(x[s:s + group_size], 0, bits))
    elif kind == "v":
        for c in range(0, x.shape[-1], group_size):
            out[..., c:c + group_size] = dequantize(quantize(x[..., c:c + group_size], -1, bits))
    else:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return out


def residual_encode(prev_hat: torch.Tensor, x: torch.Tensor, has_row: torch.Tensor, kind: str,
                    bits: int, group_size: int) -> torch.Tensor:
    """X^r from X^(r-1) (prev_hat [T, ...]) and Xr (x [T, ...]): rows with has_row [T] get
    X^(r-1) + D(Q(Xr - X^(r-1))), grouped over the compact rows; the rest inherit X^(r-1)."""
    rows = has_row.nonzero().flatten()
    out = prev_hat.clone()
    delta = x[rows] - prev_hat[rows]  # against the reconstruction, not X(r-1)
    out[rows] = prev_hat[rows] + quantize_rows(delta, kind, bits, group_size)
    return out


def seal_positions(prev_seal: torch.Tensor | None, has_row: torch.Tensor, group_size: int,
                   tail: int, safe_point: Callable[[int], int] | None = None) -> torch.Tensor:
    """Seal position per token [T] of its storage after this plane (long; NEVER for short
    groups). prev_seal None = plane 1 (every token has a row). A full group of compact rows
    seals at max(position of its last row + tail, its rows' previous seal positions),
    moved on to `safe_point` of that (the execution policy; None: serial); tokens without
    a row keep their previous seal."""
    rows = has_row.nonzero().flatten()
    seal = torch.full_like(has_row, NEVER, dtype=torch.long) if prev_seal is None else prev_seal.clone()
    for s in range(0, rows.numel(), group_size):
        group = rows[s:s + group_size]
        at = NEVER if group.numel() < group_size else int(group[-1]) + tail
        if prev_seal is not None:
            at = max(at, int(prev_seal[group].max()))
        seal[group] = at if safe_point is None else safe_point(at)
    return seal


def read_kv(exact: torch.Tensor, reconstructed: torch.Tensor, seal: torch.Tensor,
            query_positions: torch.Tensor) -> torch.Tensor:
    """What each query reads: [T, ...] exact / reconstructed -> [N, T, ...], the
    reconstruction where query position >= the token's seal position."""
    sealed = query_positions[:, None] >= seal[None, :]  # [N, T]
    sealed = sealed.view(*sealed.shape, *([1] * (exact.dim() - 1)))
    return torch.where(sealed, reconstructed[None], exact[None])


# --- model primitives (written out again; see the module docstring) --------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, heads, D] at absolute positions [N]: pairs (i, i + D/2) rotated."""
    d = x.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    angle = positions.to(acc)[:, None] * inv_freq[None, :].to(x.device, acc)  # [N, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :].to(x.dtype)
    first, second = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def _per_head(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hq, D]: each query head's K/V head (GQA)."""
    return kv.repeat_interleave(num_heads // kv.shape[-2], dim=-2)


def _causal_probs(q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax over keys at positions <= each query's: q [N, Hq, D], keys [T, Hq, D]
    (shared) or [N, T, Hq, D] (per query) -> [Hq, N, T] in the accumulation dtype."""
    acc = torch.promote_types(q.dtype, torch.float32)
    pattern = "qhd,khd->hqk" if keys.dim() == 3 else "qhd,qkhd->hqk"
    scores = torch.einsum(pattern, q.to(acc), keys.to(acc)) * q.shape[-1] ** -0.5
    future = torch.arange(keys.shape[-3], device=q.device)[None, :] > positions[:, None]
    return scores.masked_fill(future, float("-inf")).softmax(-1)


# --- the forward ----------------------------------------------------------------------

@dataclasses.dataclass
class _LayerKV:
    """One layer's storage: each token's K/V at its current depth, exact and (KV
    residuals) reconstructed; [T, Hkv, D]."""

    keys: torch.Tensor
    values: torch.Tensor
    keys_hat: torch.Tensor | None = None
    values_hat: torch.Tensor | None = None


@dataclasses.dataclass
class _Pass:
    """What every layer of one loop needs to know."""

    loop: int
    rows: torch.Tensor  # [N] absolute positions that run this loop, ascending
    run: torch.Tensor  # [T] bool
    prompt_len: int
    seal: torch.Tensor | None  # [T] (KV residuals)
    audit: FlashLoopAudit


def _check(cfg: ModelConfig, features: FlashLoopFeatures, t: int, prompt_len: int) -> None:
    sp = features.token_sparse_prefill
    if sp is not None and len(sp.retention) != cfg.num_loops:
        raise ConfigError(f"sparse prefill retention has {len(sp.retention)} values for {cfg.num_loops} loops")
    if not 0 <= prompt_len <= t:
        raise ValueError(f"prompt_len {prompt_len} outside 0..{t}")


def _prompt_selection(loop: int, sp: SparsePrefill | None, prompt_len: int, loop_hidden: list[torch.Tensor],
                      active: list[torch.Tensor], exited: torch.Tensor, audit: FlashLoopAudit) -> torch.Tensor:
    """Which prompt tokens may run `loop` [P] (before exit masking for loops 1-2)."""
    if sp is None or loop < 3 or sp.retention[loop - 1] == 1.0:
        return torch.ones(prompt_len, dtype=torch.bool, device=exited.device)
    eligible = active[-1][:prompt_len] & ~exited[:prompt_len]
    # H[r-1] is loop_hidden[r-2]; H[r-2] is loop_hidden[r-3].
    score = change_score(loop_hidden[loop - 2][:prompt_len], loop_hidden[loop - 3][:prompt_len], sp.eps)
    if sp.keep_last:
        score[prompt_len - 1] = float("inf")
    chosen = torch.zeros_like(eligible)
    for w, (s, e) in enumerate(audit.windows):
        picked = select_active(score[s:e], eligible[s:e], prefill_budget(e - s, sp.retention[loop - 1])) + s
        chosen[picked] = True
        audit.prefill_active[(loop, w)] = picked
    return chosen


def _store(kv: _LayerKV | None, k: torch.Tensor, v: torch.Tensor, ps: _Pass, layer: int,
           kvr: KVResidual | None) -> _LayerKV:
    """Write this loop's K/V of the running rows; with KV residuals encode the plane."""
    if kv is None:  # loop 1: every token runs
        kv = _LayerKV(k.clone(), v.clone())
    else:
        kv.keys[ps.rows], kv.values[ps.rows] = k, v
    if kvr is not None:
        for kind, x in (("k", kv.keys), ("v", kv.values)):
            if ps.loop == 1:
                x_hat = quantize_rows(x, kind, kvr.bits, kvr.group_size)
            else:
                prev = kv.keys_hat if kind == "k" else kv.values_hat
                x_hat = residual_encode(prev, x, ps.run, kind, kvr.bits, kvr.group_size)
            err = (x_hat[ps.rows] - x[ps.rows]).abs().max() if ps.rows.numel() else torch.zeros(())
            ps.audit.reconstruction_error[(layer, ps.loop, kind)] = float(err)
            if kind == "k":
                kv.keys_hat = x_hat
            else:
                kv.values_hat = x_hat
    return kv


def _read(kv: _LayerKV, ps: _Pass, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V as the running queries read them: [T, Hq, D] shared, or [N, T, Hq, D] per query
    under KV residuals (serial visibility)."""
    if kv.keys_hat is None:
        return _per_head(kv.keys, num_heads), _per_head(kv.values, num_heads)
    keys = read_kv(kv.keys, kv.keys_hat, ps.seal, ps.rows)
    values = read_kv(kv.values, kv.values_hat, ps.seal, ps.rows)
    return _per_head(keys, num_heads), _per_head(values, num_heads)


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ps: _Pass, layer: int,
               sd: SparseDecode | None) -> torch.Tensor:
    """Causal attention of the running queries q [N, Hq, D] -> [N, Hq, D]; generated
    queries take or use their loop-2 reference under sparse decode."""
    acc = torch.promote_types(q.dtype, torch.float32)
    probs = _causal_probs(q, ps.rows, keys)  # [Hq, N, T]
    pattern = "hqk,khd->qhd" if values.dim() == 3 else "hqk,qkhd->qhd"
    out = torch.einsum(pattern, probs, values.to(acc))
    if sd is None or ps.loop < 2:
        return out.to(q.dtype)
    for n in (ps.rows >= ps.prompt_len).nonzero().flatten().tolist():
        pos = int(ps.rows[n])
        k_n = (keys if keys.dim() == 3 else keys[n])[: pos + 1].transpose(0, 1).to(acc)  # [Hq, pos+1, D]
        v_n = (values if values.dim() == 3 else values[n])[: pos + 1].transpose(0, 1).to(acc)
        if ps.loop == 2:
            budget = decode_budget(pos + 1, sd.key_retention)
            ps.audit.decode[(pos, layer)] = decode_reference(probs[:, n, : pos + 1], v_n, budget)
            continue
        ref = ps.audit.decode[(pos, layer)]
        index = ref.keys[..., None].expand(-1, -1, q.shape[-1])
        scores = torch.einsum("hd,hbd->hb", q[n].to(acc), k_n.gather(1, index)) * q.shape[-1] ** -0.5
        out[n] = corrected_attention(ref.o_ref, ref.c_ref, ref.mass, scores, v_n.gather(1, index))
    return out.to(q.dtype)


def _layer(w: Mapping[str, torch.Tensor], cfg: ModelConfig, i: int, x: torch.Tensor, kv: list[_LayerKV | None],
           ps: _Pass, features: FlashLoopFeatures) -> torch.Tensor:
    """One physical layer for the running rows x [N, H] at their absolute positions."""
    p, eps, n = f"model.layers.{i}.", cfg.rms_norm_eps, x.shape[0]
    a = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q = (a @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_attention_heads, cfg.head_dim)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim)
    q, k = _rope(q, ps.rows, cfg.rope_theta), _rope(k, ps.rows, cfg.rope_theta)
    kv[i] = _store(kv[i], k, v, ps, i, features.kv_residual)
    keys, values = _read(kv[i], ps, cfg.num_attention_heads)
    o = _attention(q, keys, values, ps, i, features.sparse_decode).reshape(n, cfg.num_attention_heads * cfg.head_dim)
    x = x + _rms_norm(o @ w[p + "self_attn.o_proj.weight"].T, w[p + "input_layernorm_2.weight"], eps)
    m = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    m = F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    m = m @ w[p + "mlp.down_proj.weight"].T
    return x + _rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)


def flashloop_forward(
    weights: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    token_ids: torch.Tensor,
    prompt_len: int,
    features: FlashLoopFeatures = DENSE,
    exit_threshold: float | None = None,
) -> FlashLoopOutput:
    """Run all loops over `token_ids` [T] from scratch with the given features; the first
    `prompt_len` tokens are the prompt. All features off gives `reference_forward`."""
    _check(cfg, features, token_ids.shape[0], prompt_len)
    q_exit = cfg.early_exit_threshold if exit_threshold is None else exit_threshold
    w, t, num_loops = weights, token_ids.shape[0], cfg.num_loops
    device = token_ids.device
    sp, kvr = features.token_sparse_prefill, features.kv_residual

    h = w["model.embed_tokens.weight"][token_ids]  # [T, H] each token's current state
    exited = torch.zeros(t, dtype=torch.bool, device=device)
    exit_loops = torch.full((t,), num_loops, dtype=torch.long, device=device)
    last_loops = torch.zeros(t, dtype=torch.long, device=device)
    survival = torch.ones(t, dtype=torch.float32, device=device)
    kv: list[_LayerKV | None] = [None] * cfg.num_hidden_layers
    audit = FlashLoopAudit(window_bounds(prompt_len, sp.window if sp else None), {}, {}, {},
                           torch.empty(0), torch.empty(0), None, None, None)
    seal = None
    loop_hidden: list[torch.Tensor] = []
    active: list[torch.Tensor] = []
    history: list[list[_LayerKV]] = []  # per loop, each layer's storage after it
    seals: list[torch.Tensor] = []

    for loop in range(1, num_loops + 1):
        run = ~exited
        run[:prompt_len] &= _prompt_selection(loop, sp, prompt_len, loop_hidden, active, exited, audit)
        if kvr is not None:
            safe = None if kvr.policy == "serial" else (lambda x: kvr.safe_point(x, prompt_len))
            seal = seal_positions(seal, run, kvr.group_size, kvr.tail, safe)
            seals.append(seal)
        ps = _Pass(loop, run.nonzero().flatten(), run, prompt_len, seal, audit)
        x = h[ps.rows]
        for i in range(cfg.num_hidden_layers):
            x = _layer(w, cfg, i, x, kv, ps, features)
        h = h.clone()
        h[ps.rows] = _rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)

        # Exit gate only for tokens that ran: an inactive token's survival is unchanged.
        lam = exit_lambda(h[ps.rows], w["model.early_exit_gate.weight"], w["model.early_exit_gate.bias"])
        exits, survival[ps.rows] = exit_step(survival[ps.rows], lam, loop, num_loops, q_exit)
        exit_loops[ps.rows[exits]] = loop
        exited[ps.rows[exits]] = True
        last_loops[ps.rows] = loop

        loop_hidden.append(h)
        active.append(run)
        history.append([_snapshot(layer_kv) for layer_kv in kv])

    _fill_storage_audit(audit, history, seals)
    logits = h @ w["lm_head.weight"].T
    return FlashLoopOutput(
        logits=logits.to(torch.promote_types(logits.dtype, torch.float32)),
        loop_hidden=torch.stack(loop_hidden),
        exit_loops=exit_loops,
        last_loops=last_loops,
        active=torch.stack(active),
        audit=audit,
    )


def _snapshot(kv: _LayerKV) -> _LayerKV:
    """A copy of one layer's storage (later loops write into it in place)."""
    def copy(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.clone()

    return _LayerKV(kv.keys.clone(), kv.values.clone(), copy(kv.keys_hat), copy(kv.values_hat))


def _fill_storage_audit(audit: FlashLoopAudit, history: list[list[_LayerKV]], seals: list[torch.Tensor]) -> None:
    """Stack the per-loop storage snapshots into [R, L, T, Hkv, D] tensors."""
    def stack(name: str) -> torch.Tensor:
        return torch.stack([torch.stack([getattr(s, name) for s in layers]) for layers in history])

    audit.loop_keys, audit.loop_values = stack("keys"), stack("values")
    if seals:
        audit.loop_keys_hat, audit.loop_values_hat = stack("keys_hat"), stack("values_hat")
        audit.seal = torch.stack(seals)


@torch.no_grad()
def flashloop_greedy(
    weights: Mapping[str, torch.Tensor], cfg: ModelConfig, prompt: list[int], max_new_tokens: int,
    features: FlashLoopFeatures = DENSE, exit_threshold: float | None = None,
) -> list[int]:
    """Greedy continuation by full recomputation at every step (prompt_len = len(prompt))."""
    device = next(iter(weights.values())).device
    ids = list(prompt)
    for _ in range(max_new_tokens):
        out = flashloop_forward(weights, cfg, torch.tensor(ids, device=device), len(prompt), features,
                                exit_threshold)
        ids.append(int(out.logits[-1].argmax()))
    return ids[len(prompt):]
