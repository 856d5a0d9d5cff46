"""Sparse decode attention (FlashLoop RFC 3.2) in Triton, with its torch references.

    source = decode_source(q2, k_cache, v_cache, tables, positions, offsets2, page_size,
                           key_retention, capacity, max_context=L)      # loop 2
    out = decode_correction(q3, k_cache, v_cache, tables, positions, offsets3, page_size,
                            source)                                    # loops 3, 4

A generated (decode) row at loop 2 attends to all its causal keys and keeps, per query
head, the top-b keys of its probabilities; at loops >= 3 it reads only those keys of that
depth and corrects the result with what loop 2 saw of the rest:

  loop 2:  P = softmax(q . K2 / sqrt(D)) over keys 0..pos; n = pos + 1;
           b = min(n, max(1, ceil(key_retention * n)))  (`key_budget`, exact: below);
           S = the top-b keys by P, ties to the lower position; m = sum_S P;
           O_ref = sum_all P V2 (the loop-2 output); C_ref = sum_S P V2 (not renormalised).
  loop r:  p = softmax(q_r . K_r[S] / sqrt(D)) over S only;
           O = O_ref - C_ref + m * sum_S p V_r      (every key kept: dense attention).

What the functions read and write (one layer; the caller slices layers). DT is the model
dtype (`DTYPES`: fp32, bf16, fp16; the references also take fp64), N decode rows, Hq query
heads over Hkv KV heads (GQA, Hq a multiple of Hkv), D the head dim.

- q [N, Hq, D] in DT, already rotated; k_cache, v_cache [S, Hkv, D] in DT, one layer of the
  paged pool; tables [T] int, flat page tables; positions [N] int, each row's absolute
  position (negative: a padding row); table_offsets [N] int: key j of row i sits at slot
  tables[table_offsets[i] + j // page_size] * page_size + j % page_size (the page table of
  the depth being read, as in `paged_attention`: loop 2 passes depth 2's tables, the
  correction depth r's).
- `decode_source` / `source_reference` / `source_triton` (loop 2) return a `DecodeSource`:
  keys int32 [N, Hq, capacity] (S in rank order, highest P first; -1 past the row's count),
  count int32 [N] (b; 0 for padding rows), mass [N, Hq], o_ref and c_ref [N, Hq, D], all
  fp32 (fp64 for fp64 inputs, in the reference), and out [N, Hq, D] in DT: the loop-2
  attention output, o_ref rounded once to DT. `capacity` is the caller's static bound on b
  (a bucket): it must be >= every row's b. Padding rows get keys -1, count 0 and zero
  statistics, and their `out` rows are not written (zeros when no `out` is passed).
- `decode_correction` / `correction_reference` / `correction_triton` (loops >= 3) read a
  source and return out [N, Hq, D] in DT; rows with count 0 or a negative position are
  not written.

Budgets. key_retention is read as the decimal it prints as, num / den =
Fraction(repr(float(key_retention))), and b = min(n, max(1, (n * num + den - 1) // den)) in
integers: 0.1 * 30 is 3 keys, where the float product 3.0000000000000004 would round up to
4. The Triton path computes b on the device from the positions (`key_budgets`, int64; the
launchers check max_context * num + den - 1 < 2^63 on the host so it cannot overflow: a
retention of a few decimal digits allows any context, 1/3 printed as 0.3333333333333333
about 2,700 keys, and a longer context raises ValueError).

Selection, and why it is exact. The scores kernel writes every row's scaled scores
s = (q . k) * D^-0.5 in fp32 into a scratch [N, Hq, L] (L = max_context, a static bound >=
every position + 1; keys past a row's position stay -inf) and the row's lse; then, on the
device, P = exp(s - lse) (exactly 0 for the -inf keys) and each key gets the int64 rank key
(bits of P as int32) << 32 | (2^32 - 1 - position). P is a nonnegative fp32, so the order
of its bit patterns is the order of its values; the low word orders equal P by position,
lower first; every rank key is distinct, so `torch.topk(capacity)` over them has one
answer (no tie-breaking left to the sort) and it is the stable descending sort of P that
`flashloop_reference.top_positions` takes. Keys past a row's position (P = 0, positions
> pos) rank after every causal key, even one whose P underflowed to 0, and b <= n, so they
are never selected. Selection is therefore exact with respect to the P the kernel
computed; it equals the reference's selection whenever the reference's and the kernel's P
agree in order, i.e. unless two probabilities at the boundary (or, for the rank order,
anywhere in S) differ by about fp32 rounding (the tests state the gap they require).
No host sync anywhere in the launchers: budgets, selection and masking are device ops.

Kernels. (1) `_scores_kernel`, a program per (row, KV head): the GQA heads of the KV head
form the M dimension (padded to 16 for `tl.dot`) and share every K/V block loaded through
the page table; one online-softmax pass over key blocks writes the scores, lse, o_ref (fp32)
and out (DT). (2) torch on the device: P, rank keys, topk, count masking. (3)
`_selected_kernel`, a program per (row, KV head), loops over the selected keys of each head
in blocks of `block_n` (keys differ per head, so K/V are gathered per head: [G, block_n, D]
tiles) and sums m and C_ref from the same P the ranking used. (4) `_correction_kernel`, a
program per (row, KV head), gathers K_r / V_r of each head's selected keys through the
row's depth-r page table, runs an online softmax over them and writes
O_ref - C_ref + m * sum p V_r in DT. The loops of (3) and (4) stop at the row's count, so
they cost b keys, not capacity.

Cost. o_ref comes from the same single pass over K/V that writes the scores (an online
softmax, as `paged_attention` does it, without split-KV), so loop 2 reads K/V once. The
scratch (scores, P and the int64 rank keys: 16 bytes per row, query head and key of L, plus
lse) is allocated per call and dropped after it: it is not kept between loops and not
sized for CUDA graphs yet. Selection touches all of it, O(N Hq L) (a few passes of 4 to 8
bytes per query head and key, against 4 D bytes of bf16 K and V per KV head and key for
the attention itself); it is not fused into the kernel.

Precision. Scores, softmax statistics, o_ref, m, C_ref and the correction's softmax and sums
are fp32. QK runs on tensor cores in DT with fp32 accumulation (bf16 / fp16 products are
exact in fp32; fp32 inputs use IEEE fp32 products); PV of the scores kernel uses IEEE fp32
products on fp32 probabilities (o_ref is state that C_ref is subtracted from, so P is not
rounded to DT as `paged_attention` does). The gathers of (3) and (4) multiply and reduce
in fp32 on CUDA cores (their M dimension is one head). Outputs are rounded once to DT.
Under `TRITON_INTERPRET=1` tiles are cast to fp32 before `tl.dot` (the interpreter's bf16
dot is wrong) and bf16 outputs are rounded by hand (`rounding.round_to`), see
../shared/docs/gpu.md.

Not done yet: packed INT4 tiles (the runtime gathers reconstructed keys into a paged
scratch for these kernels, `runtime.sparse_decode.gathered_reader`); CUDA-graph buffer
sizing (the scratch and the source are allocated per call; `out` can be passed); a fused
device selection (the topk runs in torch); split-KV in the scores and correction kernels
(on the H200 the source costs 4-20x a dense loop and the correction loses at batch 1:
bench/results/sparse_decode_kernels_h200.json); block sizes and warps are untuned.
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES
from specloop.kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOW_WORD = (1 << 32) - 1  # the rank key's low 32 bits: 2^32 - 1 - position


@dataclasses.dataclass
class DecodeSource:
    """Loop-2 state of a batch of decode rows (module docstring): keys int32 [N, Hq, C]
    (rank order, -1 past count), count int32 [N], mass [N, Hq], o_ref / c_ref [N, Hq, D]
    (fp32; fp64 from the reference on fp64 inputs), out [N, Hq, D] in q's dtype."""

    keys: torch.Tensor
    count: torch.Tensor
    mass: torch.Tensor
    o_ref: torch.Tensor
    c_ref: torch.Tensor
    out: torch.Tensor


# --- budgets --------------------------------------------------------------------------

def retention_fraction(key_retention: float) -> tuple[int, int]:
    """(num, den) of the decimal key_retention prints as; it must lie in (0, 1]."""
    f = Fraction(repr(float(key_retention)))
    if not 0 < f <= 1:
        raise ValueError(f"key_retention must lie in (0, 1], got {key_retention!r}")
    return f.numerator, f.denominator


def key_budget(n: int, key_retention: float) -> int:
    """Keys a row with n causal keys keeps: min(n, max(1, ceil(key_retention * n))), exact;
    0 for n = 0 (a padding row). Non-decreasing in n."""
    num, den = retention_fraction(key_retention)
    return min(n, max(1, (n * num + den - 1) // den)) if n > 0 else 0


def key_budgets(positions: torch.Tensor, key_retention: float) -> torch.Tensor:
    """`key_budget(position + 1)` per row on the device, int32 [N] (no host sync);
    negative positions give 0. Exact while (position + 1) * num + den - 1 < 2^63, which
    `check_capacity` checks for positions below max_context (a long decimal such as
    1/3 = 0.3333333333333333 allows about 2,700 keys)."""
    num, den = retention_fraction(key_retention)
    n = (positions.long() + 1).clamp_min(0)
    b = torch.minimum(n, ((n * num + den - 1) // den).clamp_min(1))
    return b.to(torch.int32)


def check_capacity(max_context: int, key_retention: float, capacity: int) -> None:
    """Host-side check from Python ints: capacity covers the budget of any row whose
    position is below max_context (budgets grow with n), and the device budget cannot
    overflow int64."""
    num, den = retention_fraction(key_retention)
    if max_context < 1:
        raise ValueError(f"max_context must be positive, got {max_context}")
    if max_context * num + den - 1 >= 1 << 63:
        raise ValueError(f"key_retention {key_retention!r} has too long a decimal for max_context {max_context}")
    need = key_budget(max_context, key_retention)
    if capacity < need:
        raise ValueError(f"capacity {capacity} is below the key budget {need} of a row with max_context "
                         f"{max_context} keys at key_retention {key_retention!r}")


# --- torch references -----------------------------------------------------------------

def _row_slots(tables: torch.Tensor, offset: int, keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of a row's keys (any shape of positions >= 0)."""
    keys = keys.long()
    return tables[offset + keys // page_size].long() * page_size + keys % page_size


def _per_head_kv(cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """cache [S, Hkv, D] at per-head slots [Hq, b] -> [Hq, b, D] (query head h reads KV head
    h // group)."""
    kv_head = torch.arange(num_heads, device=slots.device) // (num_heads // cache.shape[1])
    return cache[slots, kv_head[:, None]]


def source_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                     capacity: int, *, max_context: int | None = None, out: torch.Tensor | None = None,
                     ) -> DecodeSource:
    """Loop-2 source row by row in plain PyTorch (fp32 math, fp64 for fp64 inputs); raises
    ValueError when a row's budget exceeds capacity or its position reaches max_context."""
    n_rows, num_heads, head_dim = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    keys = torch.full((n_rows, num_heads, capacity), -1, dtype=torch.int32, device=dev)
    count = torch.zeros(n_rows, dtype=torch.int32, device=dev)
    mass = torch.zeros(n_rows, num_heads, dtype=acc, device=dev)
    o_ref = torch.zeros(n_rows, num_heads, head_dim, dtype=acc, device=dev)
    c_ref = torch.zeros_like(o_ref)
    out = torch.zeros_like(q) if out is None else out
    for i in range(n_rows):
        pos = int(positions[i])
        if pos < 0:
            continue
        if max_context is not None and pos >= max_context:
            raise ValueError(f"row {i} at position {pos} is past max_context {max_context}")
        b = key_budget(pos + 1, key_retention)
        if b > capacity:
            raise ValueError(f"capacity {capacity} is below row {i}'s key budget {b} (position {pos})")
        j = torch.arange(pos + 1, device=dev).expand(num_heads, -1)  # [Hq, n]
        slots = _row_slots(tables, int(table_offsets[i]), j, page_size)
        k = _per_head_kv(k_cache, slots, num_heads).to(acc)  # [Hq, n, D]
        v = _per_head_kv(v_cache, slots, num_heads).to(acc)
        probs = (torch.einsum("hd,hnd->hn", q[i].to(acc), k) * head_dim ** -0.5).softmax(-1)
        chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :b]  # ties: lower first
        p_sel = probs.gather(-1, chosen)
        v_sel = v.gather(1, chosen[..., None].expand(-1, -1, head_dim))
        keys[i, :, :b] = chosen.to(torch.int32)
        count[i] = b
        mass[i] = p_sel.sum(-1)
        o_ref[i] = torch.einsum("hn,hnd->hd", probs, v)
        c_ref[i] = torch.einsum("hb,hbd->hd", p_sel, v_sel)
        out[i] = o_ref[i].to(q.dtype)
    return DecodeSource(keys, count, mass, o_ref, c_ref, out)


def correction_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, source: DecodeSource,
                         *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Loop >= 3 output row by row: O_ref - C_ref + m * softmax(q . K[S] / sqrt(D)) V[S], in
    the source's dtype, rounded once to q's; rows with count 0 or position < 0 unwritten."""
    n_rows, num_heads, head_dim = q.shape
    acc = source.o_ref.dtype
    out = torch.zeros_like(q) if out is None else out
    for i in range(n_rows):
        b = int(source.count[i])
        if int(positions[i]) < 0 or b == 0:
            continue
        slots = _row_slots(tables, int(table_offsets[i]), source.keys[i, :, :b], page_size)  # [Hq, b]
        k = _per_head_kv(k_cache, slots, num_heads).to(acc)
        v = _per_head_kv(v_cache, slots, num_heads).to(acc)
        local = (torch.einsum("hd,hbd->hb", q[i].to(acc), k) * head_dim ** -0.5).softmax(-1)
        o = source.o_ref[i] - source.c_ref[i] + source.mass[i][:, None] * torch.einsum("hb,hbd->hd", local, v)
        out[i] = o.to(q.dtype)
    return out


# --- Triton kernels -------------------------------------------------------------------

@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _scores_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, scores_ptr, lse_ptr, o_ref_ptr, out_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_on, stride_oh,
    num_heads, max_context, scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Per (row, KV head): scores into the scratch, lse, o_ref (fp32) and out (DT)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    if pos >= 0:
        table = tl.load(offsets_ptr + row).to(tl.int64)
        g = tl.arange(0, BLOCK_M)
        g_ok = g < GROUP
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        at = (row * num_heads + head) * max_context  # each head's scratch row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, pos + 1, BLOCK_N):
            # One block of keys through the page table, shared by the KV head's query heads.
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j <= pos
            page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + j % PAGE_SIZE
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), DOT_FP32) * scale
            s = tl.where(j_ok[None, :], s, float("-inf"))
            tl.store(scores_ptr + at[:, None] + j[None, :], s,
                     mask=g_ok[:, None] & j_ok[None, :] & (j[None, :] < max_context))
            # Online softmax; every block holds key `start` <= pos, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        o = acc / l_i[:, None]
        ok = g_ok[:, None] & d_ok[None, :]
        tl.store(lse_ptr + row * num_heads + head, m_i + tl.log(l_i), mask=g_ok)
        tl.store(o_ref_ptr + (row * num_heads + head)[:, None] * HEAD_DIM + d[None, :], o, mask=ok)
        o_dt = round_to(o, out_ptr.dtype.element_ty, BF16_BY_HAND)
        tl.store(out_ptr + row * stride_on + head[:, None] * stride_oh + d[None, :],
                 o_dt.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _selected_block(start, row, kv_head, head, g_ok, count, table, keys_ptr, tables_ptr, cache_ptr, stride_s,
                    stride_h, num_heads, capacity, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Selected keys start..start+BLOCK_N of each head [G, BLOCK_N] (ok: a real entry) and
    their rows of `cache` through the row's page table, fp32 [G, BLOCK_N, BLOCK_D]."""
    i = start + tl.arange(0, BLOCK_N)
    ok = g_ok[:, None] & (i[None, :] < count)
    sel = tl.load(keys_ptr + (row * num_heads + head)[:, None] * capacity + i[None, :], mask=ok, other=-1)
    ok = ok & (sel >= 0)
    sel = tl.where(ok, sel, 0).to(tl.int64)
    page = tl.load(tables_ptr + table + sel // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + sel % PAGE_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, :, None] & (d < HEAD_DIM)[None, None, :]
    x = tl.load(cache_ptr + slot[:, :, None] * stride_s + kv_head * stride_h + d[None, None, :], mask=mask, other=0.0)
    return sel, ok, x.to(tl.float32)


@triton.jit
def _selection_program(positions_ptr, offsets_ptr, count_ptr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """A (row, KV head) program over a row's selection: the row, KV head, position, count,
    table offset, the KV head's query heads (and which lanes are real) and channels."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    return (row, kv_head, tl.load(positions_ptr + row), tl.load(count_ptr + row),
            tl.load(offsets_ptr + row).to(tl.int64), g < GROUP, kv_head * GROUP + g, tl.arange(0, BLOCK_D))


@triton.jit
def _selected_kernel(
    probs_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, keys_ptr, count_ptr, mass_ptr, c_ref_ptr,
    stride_vs, stride_vh, num_heads, max_context, capacity,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per (row, KV head): m = sum_S P and C_ref = sum_S P V2 over each head's selection."""
    row, kv_head, pos, count, table, g_ok, head, d = _selection_program(positions_ptr, offsets_ptr, count_ptr,
                                                                        GROUP, BLOCK_G, BLOCK_D)
    if (pos >= 0) & (count > 0):
        mass = tl.zeros([BLOCK_G], tl.float32)
        c = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, count, BLOCK_N):
            sel, ok, v = _selected_block(start, row, kv_head, head, g_ok, count, table, keys_ptr, tables_ptr, v_ptr,
                                         stride_vs, stride_vh, num_heads, capacity, PAGE_SIZE, HEAD_DIM, BLOCK_N,
                                         BLOCK_D)
            p = tl.load(probs_ptr + (row * num_heads + head)[:, None] * max_context + sel, mask=ok, other=0.0)
            mass += tl.sum(p, axis=1)
            c += tl.sum(p[:, :, None] * v, axis=1)
        tl.store(mass_ptr + row * num_heads + head, mass, mask=g_ok)
        tl.store(c_ref_ptr + (row * num_heads + head)[:, None] * HEAD_DIM + d[None, :], c,
                 mask=g_ok[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _correction_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, keys_ptr, count_ptr, mass_ptr, o_ref_ptr,
    c_ref_ptr, out_ptr, stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_on, stride_oh,
    num_heads, capacity, scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Per (row, KV head): softmax of q_r . K_r over each head's S, corrected by the source."""
    row, kv_head, pos, count, table, g_ok, head, d = _selection_program(positions_ptr, offsets_ptr, count_ptr,
                                                                        GROUP, BLOCK_G, BLOCK_D)
    if (pos >= 0) & (count > 0):
        d_ok = d < HEAD_DIM
        ok_gd = g_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :], mask=ok_gd, other=0.0)
        q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, count, BLOCK_N):
            _, ok, k = _selected_block(start, row, kv_head, head, g_ok, count, table, keys_ptr, tables_ptr, k_ptr,
                                       stride_ks, stride_kh, num_heads, capacity, PAGE_SIZE, HEAD_DIM, BLOCK_N,
                                       BLOCK_D)
            _, _, v = _selected_block(start, row, kv_head, head, g_ok, count, table, keys_ptr, tables_ptr, v_ptr,
                                      stride_vs, stride_vh, num_heads, capacity, PAGE_SIZE, HEAD_DIM, BLOCK_N,
                                      BLOCK_D)
            s = tl.sum(q[:, None, :] * k, axis=2) * scale  # [G, BLOCK_N], fp32 products
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads see no key
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
            m_i = m_new
        local = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        at = (row * num_heads + head)[:, None] * HEAD_DIM + d[None, :]
        o_ref = tl.load(o_ref_ptr + at, mask=ok_gd, other=0.0)
        c_ref = tl.load(c_ref_ptr + at, mask=ok_gd, other=0.0)
        mass = tl.load(mass_ptr + row * num_heads + head, mask=g_ok, other=0.0)
        o = o_ref - c_ref + mass[:, None] * local
        o_dt = round_to(o, out_ptr.dtype.element_ty, BF16_BY_HAND)
        tl.store(out_ptr + row * stride_on + head[:, None] * stride_oh + d[None, :],
                 o_dt.to(out_ptr.dtype.element_ty), mask=ok_gd)


# --- launchers ------------------------------------------------------------------------

def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           positions: torch.Tensor, table_offsets: torch.Tensor) -> None:
    """Layout assertions (no host sync: shapes, dtypes and strides only)."""
    n, num_heads, head_dim = q.shape
    assert q.dtype in DTYPES, f"sparse decode kernels take {', '.join(map(str, DTYPES))}, not {q.dtype}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, "K and V caches must be [S, Hkv, D]"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q and the caches share the model dtype"
    assert num_heads % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    assert positions.shape == (n,) and table_offsets.shape == (n,), "positions and table offsets: [N]"
    for t in (tables, positions, table_offsets):
        assert t.is_contiguous() and not t.is_floating_point(), "tables, positions and offsets: contiguous ints"


def _shape(q: torch.Tensor, k_cache: torch.Tensor, page_size: int) -> dict:
    num_heads, head_dim = q.shape[1], q.shape[2]
    return dict(PAGE_SIZE=page_size, GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


def select_keys(scores: torch.Tensor, lse: torch.Tensor, count: torch.Tensor,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`count` keys of P = exp(scores - lse) per (row, head), on the device, no host
    sync: keys int32 [N, Hq, capacity] in rank order (-1 past count) and P fp32
    [N, Hq, L]. The rank key (bits of P) << 32 | (2^32 - 1 - position) is distinct per key
    and orders by P, then lower position (module docstring)."""
    n, num_heads, length = scores.shape
    probs = torch.exp(scores - lse[..., None])
    position = torch.arange(length, device=scores.device, dtype=torch.int64)
    rank = (probs.view(torch.int32).to(torch.int64) << 32) | (_LOW_WORD - position)
    top = rank.topk(min(capacity, length), dim=-1, sorted=True).indices.to(torch.int32)
    keys = torch.full((n, num_heads, capacity), -1, dtype=torch.int32, device=scores.device)
    rank_of = torch.arange(top.shape[-1], device=scores.device)
    keys[..., : top.shape[-1]] = torch.where(rank_of < count[:, None, None], top, -1)
    return keys, probs


def source_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                  capacity: int, *, max_context: int, block_n: int = 32, out: torch.Tensor | None = None,
                  ) -> DecodeSource:
    """Loop-2 source on the device: scores kernel, torch selection, selected-sum kernel; no
    host sync. max_context (static, > every position) sizes the scratch and bounds the
    budget that `capacity` must cover (checked here from Python ints)."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets)
    check_capacity(max_context, key_retention, capacity)
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    dev = q.device
    shape = _shape(q, k_cache, page_size)
    by_hand = _INTERPRET and q.dtype == torch.bfloat16
    scores = torch.full((n, num_heads, max_context), float("-inf"), dtype=torch.float32, device=dev)
    lse = torch.zeros(n, num_heads, dtype=torch.float32, device=dev)  # padding rows: P = exp(-inf) = 0
    o_ref = torch.zeros(n, num_heads, head_dim, dtype=torch.float32, device=dev)
    out = torch.zeros_like(q) if out is None else out
    if n > 0:
        _scores_kernel[(n, num_kv_heads)](
            q, k_cache, v_cache, tables, positions, table_offsets, scores, lse, o_ref, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1), num_heads, max_context, head_dim ** -0.5,
            BLOCK_M=max(16, triton.next_power_of_2(shape["GROUP"])), BLOCK_N=block_n,
            DOT_FP32=_INTERPRET or q.dtype == torch.float32, BF16_BY_HAND=by_hand, **shape,
        )
    count = key_budgets(positions, key_retention)
    keys, probs = select_keys(scores, lse, count, capacity)
    mass = torch.zeros(n, num_heads, dtype=torch.float32, device=dev)
    c_ref = torch.zeros_like(o_ref)
    if n > 0:
        _selected_kernel[(n, num_kv_heads)](
            probs, v_cache, tables, positions, table_offsets, keys, count, mass, c_ref,
            v_cache.stride(0), v_cache.stride(1), num_heads, max_context, capacity,
            BLOCK_G=triton.next_power_of_2(shape["GROUP"]), BLOCK_N=block_n, **shape,
        )
    return DecodeSource(keys, count, mass, o_ref, c_ref, out)


def correction_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, source: DecodeSource,
                      *, block_n: int = 32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Loop >= 3 output: one program per (row, KV head) over the row's count selected keys;
    no host sync."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets)
    n, num_heads, head_dim = q.shape
    assert source.keys.shape[:2] == (n, num_heads) and source.keys.is_contiguous(), "keys: [N, Hq, C] contiguous"
    assert source.o_ref.dtype == source.c_ref.dtype == source.mass.dtype == torch.float32, "source state is fp32"
    assert source.o_ref.is_contiguous() and source.c_ref.is_contiguous() and source.mass.is_contiguous()
    out = torch.zeros_like(q) if out is None else out
    if n == 0:
        return out
    shape = _shape(q, k_cache, page_size)
    _correction_kernel[(n, k_cache.shape[1])](
        q, k_cache, v_cache, tables, positions, table_offsets, source.keys, source.count, source.mass,
        source.o_ref, source.c_ref, out, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), num_heads, source.keys.shape[2],
        head_dim ** -0.5, BLOCK_G=triton.next_power_of_2(shape["GROUP"]), BLOCK_N=block_n,
        BF16_BY_HAND=_INTERPRET and q.dtype == torch.bfloat16, **shape,
    )
    return out


# --- dispatch -------------------------------------------------------------------------

def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Triton on CUDA tensors or under TRITON_INTERPRET=1 by default (the kernels' dtypes
    only: fp64 goes to the reference); the reference otherwise."""
    if use_triton is None:
        return (x.is_cuda or _INTERPRET) and x.dtype in DTYPES
    assert not use_triton or x.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    return use_triton


def decode_source(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                  capacity: int, *, max_context: int, block_n: int = 32, out: torch.Tensor | None = None,
                  use_triton: bool | None = None) -> DecodeSource:
    """Loop-2 source (module docstring); checks capacity against max_context on the host
    from Python ints before either implementation runs."""
    check_capacity(max_context, key_retention, capacity)
    args = (q, k_cache, v_cache, tables, positions, table_offsets, page_size, key_retention, capacity)
    if _use_triton(q, use_triton):
        return source_triton(*args, max_context=max_context, block_n=block_n, out=out)
    return source_reference(*args, max_context=max_context, out=out)


def decode_correction(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, source: DecodeSource,
                      *, block_n: int = 32, out: torch.Tensor | None = None,
                      use_triton: bool | None = None) -> torch.Tensor:
    """Loop >= 3 output from a loop-2 source (module docstring)."""
    args = (q, k_cache, v_cache, tables, positions, table_offsets, page_size, source)
    if _use_triton(q, use_triton):
        return correction_triton(*args, block_n=block_n, out=out)
    return correction_reference(*args, out=out)
