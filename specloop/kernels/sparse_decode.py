"""Sparse decode attention (FlashLoop RFC 3.2) in Triton, with its torch references.

    state = SlotState.zeros(num_slots, Hq, D, capacity, device=...)        # one layer's
    decode_source(q2, k_cache, v_cache, tables, positions, offsets2, page_size, key_retention,
                  dense=out2, slots=slots, state=state, max_context=L)    # loop 2
    decode_correction(q3, k_cache, v_cache, tables, positions, offsets3, page_size,
                      slots=slots, state=state, out=out3)                  # loops 3, 4

or, at loop 2, with the scores kept by the dense launch itself (Triton only):

    out2, lse = paged_attention(..., return_lse=True, scores=scratch, score_rows=rows)
    decode_select(v_cache, tables, positions, offsets2, page_size, key_retention,
                  dense=out2, lse=lse, scores=scratch, slots=slots, state=state, max_context=L)

A generated (decode) row at loop 2 attends to all its causal keys and keeps, per query
head, the top-b keys of its probabilities; at loops >= 3 it reads only those keys of that
depth and corrects the result with what loop 2 saw of the rest:

  loop 2:  P = softmax(q . K2 / sqrt(D)) over keys 0..pos; n = pos + 1;
           b = min(n, max(1, ceil(key_retention * n)))  (`key_budget`, exact: below);
           S = the top-b keys by P, ties to the lower position; m = sum_S P;
           C_ref = sum_S P V2 (not renormalised); O_ref = the row's loop-2 output.
  loop r:  p = softmax(q_r . K_r[S] / sqrt(D)) over S only;
           O = O_ref - C_ref + m * sum_S p V_r      (every key kept: dense attention).

What the functions read and write (one layer; the caller slices layers). DT is the model
dtype (`DTYPES`: fp32, bf16, fp16; the references also take fp64), N rows, Hq query heads
over Hkv KV heads (GQA, Hq a multiple of Hkv), D the head dim.

- q [N, Hq, D] in DT, already rotated; k_cache, v_cache [Spool, Hkv, D] in DT, one layer of
  the paged pool; tables [T] int, flat page tables; positions [N] int, each row's absolute
  position (negative: a padding row, which reads and writes nothing); table_offsets [N]
  int: key j of row i sits at pool slot tables[table_offsets[i] + j // page_size] *
  page_size + j % page_size (the page table of the depth being read: depth 2's for the
  source, depth r's for the correction); slots [N] int64: each row's token slot in the
  state (a padding row's slot is never read, so it may lie outside the state).
- The state (`SlotState`) lives in token slots, so it outlives the call: keys int32
  [S, Hq, C] (each head's kept positions, ascending; entries at or past the count are never
  read), count int32 [S] (b), mass [S, Hq], o_ref and c_ref [S, Hq, D], fp32 (fp64 in the
  references for fp64 inputs). C is the capacity, a static bound on b: `check_capacity`
  checks on the host that it covers the budget of any position below max_context.
- `decode_source` (loop 2) writes, for each non-padding row, its slot's keys[:, :b], count,
  mass, c_ref and o_ref = dense[i] in fp32. `dense` [N, Hq, D] in DT is the rows' loop-2
  attention, which the caller's dense kernel has already computed: the source adds no
  output of its own. max_context is a static bound > every position: it sizes the scratch
  (positions at or past it are a caller error; the kernels clamp them to stay in bounds).
- `decode_correction` (loops >= 3) writes out[i] = O_ref - C_ref + m * sum_S p V_r,
  rounded once to DT, for rows with a position >= 0 whose slot's count is > 0; every other
  row of `out` (the caller's dense output, corrected in place) is left untouched.

Budgets. key_retention is read as the decimal it prints as, num / den =
Fraction(repr(float(key_retention))), and b = min(n, max(1, (n * num + den - 1) // den)) in
integers: 0.1 * 30 is 3 keys, where the float product 3.0000000000000004 would round up to
4. The select kernel computes b from (num, den) in int64; `check_capacity` checks
max_context * num + den - 1 < 2^63 on the host so it cannot overflow: a retention of a few
decimal digits allows any context, 1/3 printed as 0.3333333333333333 about 2,700 keys, and a
longer context raises ValueError.

Kernels (Triton), per chunk of rows (`scratch` [R, Hq, >= max_context] fp32 holds R rows'
scores; the host loops over the N rows R at a time, both kernels per chunk):

1. `_scores_kernel`, grid (R, Hkv, splits): each program takes an equal share of its row's
   keys 0..pos (the share is computed on the device from the position), loads K blocks
   through the page table once for the KV head's GQA query heads (the M dimension, padded
   to 16 for `tl.dot`) and stores s = q . k * D^-0.5 in fp32 into the scratch. No V, no
   softmax. `score_splits` picks the splits from static values (rows, Hkv, max_context, SM
   count; two waves of the GPU, shares of at least 256 keys): batch 1 at 32K keys with 16 KV
   heads on the H200's 132 SMs gets 17 splits, batch 32 gets 1.
2. `_select_kernel`, grid (R, Hq), one program per (row, query head) over its scratch row:
   pass 1: lse (a running max and sum per lane; `decode_select` takes the dense launch's
   lse instead and skips this pass, its scores having been stored by that launch); P = exp(s - lse), recomputed by the same
   expression in every later pass. P is a nonnegative fp32 below 2, so its bits, as int32,
   order like its values and fit in 30 bits. A radix select over those bits, most
   significant digit first (8-bit digits: 4 passes of `tl.histogram` with a mask, each
   counting only the keys whose higher digits match the prefix found so far), finds the
   b-th largest pattern T and `need`, how many keys equal to T belong to the top b. A last
   pass in key order keeps P > T and the first `need` keys with P == T (one `tl.cumsum` of
   both counts, with running offsets across blocks) and writes their positions compacted,
   ascending, to the slot's keys; then a loop over those b positions sums m and C_ref with V
   gathered through the page table (only the kept keys are loaded). It writes count, mass,
   c_ref and o_ref (dense copied to fp32).
3. `_correction_kernel`, grid (N, Hkv, splits): for each head of the KV head, gathers K_r
   and V_r of its split's share of the slot's kept keys through the row's depth-r page
   table and runs an online softmax over them. With one split it writes
   O_ref - C_ref + m * sum p V_r into out[i] in DT; with more (`correction_splits`: batch 1
   would otherwise run 16 programs on 132 SMs) each split writes its max, sum and
   unnormalised sum of p V to fp32 partials, and `_combine_kernel`, grid (N, Hq), merges
   the splits that held keys and writes out[i].

Why the selection is exact. The kept set is defined by values only: every key with P > T
and the lowest-positioned keys with P == T, T being the b-th largest P. That is the set of
the first b keys of a stable descending sort of P (`flashloop_reference.top_positions`), so
no tie-breaking is left to the hardware or to block boundaries. Every pass computes P by
one expression, so the histograms and the final pass see the same bits. Selection is thus
exact with respect to the P the kernel computed; it equals the reference's whenever the
kernel's and the reference's P agree in order at the boundary, i.e. unless the b-th and
(b+1)-th probabilities differ by about fp32 rounding (the tests state the gap they
require). Keys with equal scores get equal P on both sides, so exact ties break alike.

CUDA graphs. No host sync, no `.item()`, no mask indexing; grids come from tensor shapes
and static arguments (the chunk loop is a Python loop over static sizes); budgets,
selection and masking are device work. A padding row's programs exit after reading its
position, in every kernel. The scratch is passed in (`scratch_rows` sizes one for a byte
budget; without one the source allocates min(N, rows under SCRATCH_BYTES) rows).

Cost per row (one layer). Scores: K once (2 D bytes per KV head and key in bf16) and 4 bytes
per query head and key written to the scratch. Select: the scratch row read 6 times (lse, 4
digits, the compaction: 24 bytes per query head and key, from L2 while the chunk's scratch
fits there) and b rows of V. Correction: b rows of K and V per query head. A dense loop
reads K and V (4 D bytes per KV head and key). Triton 3.9 lowers `tl.histogram` to one
shared-memory atomic per key, which contend on the top digits, where many P share an
exponent.

Precision. Scores, softmax statistics, m, C_ref and the correction's softmax and sums are
fp32. QK runs on tensor cores in DT with fp32 accumulation (bf16 / fp16 products are exact
in fp32; fp32 inputs use IEEE fp32 products); the V gathers of (2) and both gathers of (3)
multiply and reduce in fp32 on CUDA cores (their M dimension is one head). Outputs are
rounded once to DT. Under `TRITON_INTERPRET=1` tiles are cast to fp32 before `tl.dot` (the
interpreter's bf16 dot is wrong) and bf16 outputs are rounded by hand
(`rounding.round_to`), see ../shared/docs/gpu.md.

The split select (`Blocks.select_splits` > 1, `decode_select` only): `splits` programs
per (row, query head) each take a share of whole select blocks. One launch per digit adds
each share's histogram of the digit to the (row, head)'s global one (`tl.atomic_add`; the
launch boundary orders the digits); every program re-derives the prefix from the global
histograms, so all of them agree on T and `need` without talking. A count launch gives
each share's keys above T and equal to it; the write launch starts each share's kept keys
at the offset the earlier shares' counts give (equal keys still go to the lowest
positions) and sums its kept keys' m and C_ref into a partial; a finish launch adds the
partials and writes the slot. Same kept set as the one-program select; sums in another
order. `select_splits` picks the split count for two waves of the GPU from static values
(1, the one-program select, once the rows alone fill two waves): on the H200 with 512-key
blocks the split select ran 1.9x faster at 1 x 8K (8 splits) and 4.6x at 1 x 32K (17),
and batch 32 keeps one program (bench/results/sparse_decode_kernels_h200.json).

INT4 residual planes. `decode_source` and `decode_correction` take `packed=PackedRows(...)`:
their caches and tables are then the planes' BF16 tails, and each key is read as the row
reads it by the packed reader's own gather (`packed_attention._key_block`, key by key: the
scores kernel over keys 0..pos, the select's V sums and the correction on the kept
positions alone), launched without FMA contraction like that reader so the reconstruction
rounds the same way; the scores kernel decodes K alone, the V sums V alone. The
references read the rows' keys into a paged copy
(`read_keys_reference`) and run from it. `decode_select` takes `packed` too: the packed
reader keeps the source rows' scores and lse as the paged kernel does
(`packed_attention(..., scores=, score_rows=)`), and the select (one program or split)
sums V of the kept keys from the planes.

Not done: the one-program select has Hq
programs per row, so at batch 1 it runs on 16 of 132 SMs, its passes bound by latency
(lse could come from the scores kernel, one pass fewer, and the V gather is not
software-pipelined); block sizes and warps are barely measured on the H200 (`Blocks`;
bench/sparse_decode_kernels.py).
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES
from specloop.kernels.packed_attention import PackedKV, _key_block, read_keys_reference
from specloop.kernels.paged_attention import choose_splits
from specloop.kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCRATCH_BYTES = 256 << 20  # the scratch a source allocates when it is given none
PATTERN_BITS = 30  # P < 2, so the bits of a nonnegative fp32 P fit in 30 bits
_PATTERN_BITS = tl.constexpr(PATTERN_BITS)


@dataclasses.dataclass
class SlotState:
    """One layer's reference state, indexed by token slot (S slots): keys int32 [S, Hq, C]
    (each head's kept key positions in ascending order; entries at or past the slot's count
    are unspecified and never read), count int32 [S], mass [S, Hq], o_ref and c_ref
    [S, Hq, D] (fp32; the references also accept fp64). All contiguous."""

    keys: torch.Tensor
    count: torch.Tensor
    mass: torch.Tensor
    o_ref: torch.Tensor
    c_ref: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, num_heads: int, head_dim: int, capacity: int, *,
              dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> SlotState:
        """A zeroed state for `num_slots` slots of `capacity` kept keys per head."""
        def new(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(new(num_slots, num_heads, capacity, dtype=torch.int32), new(num_slots, dtype=torch.int32),
                   new(num_slots, num_heads), new(num_slots, num_heads, head_dim),
                   new(num_slots, num_heads, head_dim))


@dataclasses.dataclass
class PackedRows:
    """Keys on INT4 residual planes: the layer's packed planes and each row's cell and depth
    [N] (int). With it the caches and page tables `decode_source` / `decode_correction`
    take are the planes' BF16 tails and their tables, and each key is read as the row reads
    it: reconstructed from the packed records where the row's position has passed the key's
    seal, exact from the tail otherwise (`specloop.kernels.packed_attention`)."""

    packed: PackedKV
    cells: torch.Tensor
    depths: torch.Tensor

    def check(self, n: int) -> None:
        for t in (self.cells, self.depths):
            assert t.shape == (n,) and t.is_contiguous() and not t.is_floating_point(), "cells, depths: [N] ints"

    def kernel_args(self, n: int, head_dim: int) -> tuple[tuple, dict]:
        """The packed arguments of a kernel launch over n rows and their constexprs (no FMA
        contraction: the reconstruction rounds lo + scale * code alone, as the packed reader
        does)."""
        self.check(n)
        pk = self.packed
        return ((pk.k.codes, pk.k.scale, pk.k.lo, pk.v.codes, pk.v.scale, pk.v.lo, pk.seal, pk.group_tables,
                 pk.row_maps, self.cells, self.depths, pk.group_tables.shape[2], pk.row_maps.shape[2]),
                dict(PACKED=True, PLANES=pk.planes, V_GROUPS=triton.cdiv(head_dim, 64), enable_fp_fusion=False))

    @staticmethod
    def no_args(any_tensor: torch.Tensor) -> tuple[tuple, dict]:
        """`kernel_args` of a launch without packed planes (never read)."""
        return (any_tensor,) * 11 + (0, 0), dict(PACKED=False, PLANES=1, V_GROUPS=1)

    def gather(self, k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
               table_offsets: torch.Tensor, page_size: int) -> tuple:
        """The rows' keys 0..pos as they read them, in a paged copy of their own (the
        reference's way in: `read_keys_reference`): K, V, tables, offsets, page size."""
        n = positions.shape[0]
        keys = -(-max(int(positions.max()) + 1 if n else 1, 1) // page_size) * page_size
        k, v = read_keys_reference(k_tail, v_tail, tables, page_size, self.packed, self.cells, self.depths,
                                   positions, table_offsets, keys)
        per_row = keys // page_size
        dev = k_tail.device
        return (k.reshape(n * keys, *k.shape[2:]), v.reshape(n * keys, *v.shape[2:]),
                torch.arange(n * per_row, device=dev), torch.arange(n, device=dev) * per_row, page_size)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Static tuning of the Triton path (powers of two). `splits`: programs per (row, KV
    head) of the scores kernel, None for `score_splits`."""

    scores: int = 64  # keys per block of the scores kernel (>= 16: tl.dot)
    select: int = 2048  # keys per block of the select kernel's passes (32..32768)
    gather: int = 128  # kept keys per block of the select's V gather (128: 6-13% faster than 64 on the H200)
    correction: int = 32  # kept keys per block of the correction kernel
    radix_bits: int = 8  # digit of the radix select: 8 bits is 4 counting passes, 10 or 11 bits 3
    select_warps: int = 8
    splits: int | None = None
    correction_splits: int | None = None  # programs per (row, KV head) of the correction; None: `correction_splits`
    select_splits: int | None = None  # programs per (row, head) of `decode_select`'s select; None: `select_splits`
    split_select: int = 512  # keys per block of the split select's passes (32..32768)


def scratch_keys(max_context: int) -> int:
    """A scores scratch row's length: max_context rounded up to 16 keys, so the scratch's
    strides are the same multiples of 16 at every context (one kernel variant)."""
    return -(-max_context // 16) * 16


def scratch_rows(num_heads: int, max_context: int, budget_bytes: int) -> int:
    """Rows of a [rows, Hq, scratch_keys(max_context)] fp32 scores scratch that fit in
    budget_bytes (at least one): a source runs its rows in chunks of that many."""
    return max(1, budget_bytes // (num_heads * scratch_keys(max_context) * 4))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def score_splits(rows: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Programs per (row, KV head) of the scores kernel, from static values only: enough for
    two waves of the GPU, no share under 256 keys (`paged_attention.choose_splits`); batch 1
    at 32K keys and 16 KV heads on 132 SMs gets 17."""
    return choose_splits(rows, num_kv_heads, max_context, num_sms)


def select_splits(rows: int, num_heads: int, max_context: int, num_sms: int, block: int) -> int:
    """Programs per (row, query head) of the split select, from static values only: two
    waves of the GPU, shares of at least two select blocks, at most 32 (1: the one-program
    select; the default, `Blocks.select_splits` None)."""
    return choose_splits(rows, num_heads, max_context, num_sms, min_keys=2 * block, max_splits=32)


def correction_splits(rows: int, num_kv_heads: int, capacity: int, num_sms: int) -> int:
    """Programs per (row, KV head) of the correction, from static values only: eight waves
    of the GPU and at least one split per 256 kept keys of the capacity, no share under 64
    keys, at most 64 splits. Its gathers are bound by latency, not bandwidth, so more
    programs in flight pay past the two waves a bandwidth-bound kernel wants: at batch 1
    and 32K (capacity 3303; this rule gives 51) 32 and 64 splits took 30 and 24 us a call
    against 41 for the 17 of two waves, on the H200 with the layers' data cold in L2
    (bench/results/sparse_decode_kernels_cold_skew0_h200.json).
    Shares are cut on the device from each row's count, so splits past a short row's keys
    exit at once."""
    waves = -(-8 * num_sms // max(1, rows * num_kv_heads))
    return max(1, min(64, capacity // 64, max(waves, capacity // 256)))


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
    """cache [Spool, Hkv, D] at per-head slots [Hq, b] -> [Hq, b, D] (query head h reads KV
    head h // group)."""
    kv_head = torch.arange(num_heads, device=slots.device) // (num_heads // cache.shape[1])
    return cache[slots, kv_head[:, None]]


def source_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                     *, dense: torch.Tensor, slots: torch.Tensor, state: SlotState,
                     max_context: int | None = None) -> None:
    """Loop-2 state row by row in plain PyTorch (fp32 math, fp64 for fp64 inputs): the top-b
    keys of each head by a stable descending sort of P, stored in ascending position order.
    Raises ValueError when a row's budget exceeds the capacity or its position reaches
    max_context."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    capacity = state.keys.shape[2]
    for i in range(q.shape[0]):
        pos = int(positions[i])
        if pos < 0:
            continue
        if max_context is not None and pos >= max_context:
            raise ValueError(f"row {i} at position {pos} is past max_context {max_context}")
        b = key_budget(pos + 1, key_retention)
        if b > capacity:
            raise ValueError(f"capacity {capacity} is below row {i}'s key budget {b} (position {pos})")
        j = torch.arange(pos + 1, device=q.device).expand(num_heads, -1)  # [Hq, n]
        kv = _row_slots(tables, int(table_offsets[i]), j, page_size)
        k = _per_head_kv(k_cache, kv, num_heads).to(acc)  # [Hq, n, D]
        v = _per_head_kv(v_cache, kv, num_heads).to(acc)
        probs = (torch.einsum("hd,hnd->hn", q[i].to(acc), k) * head_dim ** -0.5).softmax(-1)
        top = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :b]  # ties: lower first
        kept = top.sort(-1).values  # [Hq, b], ascending positions
        p = probs.gather(-1, kept)
        slot = int(slots[i])
        state.keys[slot, :, :b] = kept.to(torch.int32)
        state.count[slot] = b
        state.mass[slot] = p.sum(-1)
        state.c_ref[slot] = torch.einsum("hb,hbd->hd", p, v.gather(1, kept[..., None].expand(-1, -1, head_dim)))
        state.o_ref[slot] = dense[i]


def correction_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                         slots: torch.Tensor, state: SlotState, out: torch.Tensor,
                         dense_rows: torch.Tensor | None = None) -> None:
    """Loop >= 3 output row by row: out[i] = O_ref - C_ref + m * softmax(q . K[S] / sqrt(D)) V[S]
    in the state's dtype (at least fp32), rounded once to out's; rows with a negative
    position or a slot of count 0 are left untouched. A row set in `dense_rows` ([N] bool:
    its slot's state is missing) gets dense attention over its keys 0..pos instead and
    reads nothing of the state."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, state.o_ref.dtype)
    for i in range(q.shape[0]):
        pos = int(positions[i])
        if pos < 0:
            continue
        slot = int(slots[i])
        full = dense_rows is not None and bool(dense_rows[i])
        b = pos + 1 if full else int(state.count[slot])
        if b == 0:
            continue
        keys = torch.arange(b, device=q.device).expand(num_heads, -1) if full else state.keys[slot, :, :b]
        kv = _row_slots(tables, int(table_offsets[i]), keys, page_size)  # [Hq, b]
        k = _per_head_kv(k_cache, kv, num_heads).to(acc)
        v = _per_head_kv(v_cache, kv, num_heads).to(acc)
        local = torch.einsum("hb,hbd->hd", (torch.einsum("hd,hbd->hb", q[i].to(acc), k) * head_dim ** -0.5)
                             .softmax(-1), v)
        if full:
            out[i] = local.to(out.dtype)
            continue
        o = state.o_ref[slot].to(acc) - state.c_ref[slot].to(acc) + state.mass[slot].to(acc)[:, None] * local
        out[i] = o.to(out.dtype)


# --- Triton kernels -------------------------------------------------------------------
# `max_context` is not specialized: an eager pass passes its own longest context, and a
# new divisibility by 16 would compile a new variant inside a request
# (`bench/compile_variants.py`); the scratch's strides stay multiples of 16 instead
# (`scratch_keys`).

@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["max_context"])
def _scores_kernel(
    q_ptr, k_ptr, tables_ptr, positions_ptr, offsets_ptr, scratch_ptr,
    first, stride_qn, stride_qh, stride_ks, stride_kh, stride_xr, stride_xh, max_context, splits, scale,
    v_ptr, stride_vs, stride_vh, num_kv_heads,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Per (row of the chunk, KV head, split): s = q . k * D^-0.5 (fp32) of the split's share
    of keys 0..pos, for the KV head's query heads, into the scratch. PACKED: k (and v) are
    INT4 residual planes' tails and each key is read as the row reads it (`_key_block`)."""
    r = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = first + r
    pos = tl.load(positions_ptr + row).to(tl.int64)
    if pos >= 0:
        lo, hi = _split_share(tl.minimum(pos + 1, max_context), split, splits, BLOCK_N)
        table = tl.load(offsets_ptr + row).to(tl.int64)
        g = tl.arange(0, BLOCK_M)
        g_ok = g < GROUP
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        at = r * stride_xr + head * stride_xh  # each head's scratch row
        cell = row * 0
        depth = kv_head * 0
        if PACKED:
            cell = tl.load(cell_ptr + row).to(tl.int64)
            depth = tl.load(depth_ptr + row).to(tl.int32)
        for start in range(lo, hi, BLOCK_N):
            # One block of keys through the page table, shared by the KV head's query heads.
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            if PACKED:
                k, _v = _key_block(
                    j, j_ok, cell, depth, pos.to(tl.int32), table, kv_head, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                    k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
                    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
                    PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, 1)  # K alone
                k = k.to(q_ptr.dtype.element_ty)  # fp32 holding the dtype's values: exact
            else:
                page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
                slot = page * PAGE_SIZE + j % PAGE_SIZE
                k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                            mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), DOT_FP32) * scale
            tl.store(scratch_ptr + at[:, None] + j[None, :], s, mask=g_ok[:, None] & j_ok[None, :])


@triton.jit
def _probs(x_row, j, ok, lse):
    """P = exp(s - lse) of keys j of a scratch row (0 where not ok) and its bits as int32:
    P is a nonnegative fp32 below 2, so its bits order like its values and fit in 30 bits.
    Every pass computes P by this one expression, so every pass sees the same bits."""
    p = tl.exp(tl.load(x_row + j, mask=ok, other=float("-inf")) - lse)
    return p, p.to(tl.int32, bitcast=True)


@triton.jit
def _prob_bits(x_row, j, ok, lse):
    """`_probs`'s bits alone (no throwaway name: Triton carries `_` through loops as a
    variable, and its type may not change from one assignment to the next)."""
    p, bits = _probs(x_row, j, ok, lse)
    return bits


@triton.jit
def _row_lse(x_row, n, BLOCK_S: tl.constexpr):
    """log sum_j exp(s_j) over keys 0..n-1 of a scratch row (a running max and sum per lane)."""
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, n, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        s = tl.load(x_row + j, mask=j < n, other=float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen no key yet
        l = l * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
    top = tl.max(m, axis=0)  # key 0 exists: finite
    return top + tl.log(tl.sum(l * tl.exp(m - top), axis=0))


@triton.jit
def _radix_select(x_row, n, lse, b, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The b-th largest P bit pattern T of keys 0..n-1 and `need`, how many keys equal to T
    are among the top b (1 <= need <= their count): one histogram pass per digit, most
    significant first, over the keys whose higher digits match T's."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    bins = tl.arange(0, BINS)
    need = b  # rank of T among the keys that match the prefix found so far
    prefix = b * 0
    for digit in tl.static_range(DIGITS):
        shift = (DIGITS - 1 - digit) * RADIX_BITS
        hist = tl.zeros([BINS], tl.int32)
        for start in range(0, n, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < n
            x = _prob_bits(x_row, j, ok, lse)
            if digit > 0:
                ok = ok & ((x >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
            hist += tl.histogram((x >> shift) & (BINS - 1), BINS, mask=ok)
        prefix, need = _digit_step(hist, bins, prefix, need, shift)
    return prefix, need


@triton.jit
def _digit_step(hist, bins, prefix, need, shift):
    """One digit of the radix select: from the digit's histogram over the keys matching
    the prefix so far, the digit of the need-th largest and its rank among the keys that
    share it."""
    at_least = tl.cumsum(hist, axis=0, reverse=True)  # keys whose digit is >= each bin
    value = tl.max(tl.where(at_least >= need, bins, 0), axis=0)  # the digit of the need-th
    need -= tl.sum(tl.where(bins == value, at_least - hist, 0), axis=0)  # minus those above it
    return prefix | (value << shift), need


@triton.jit
def _write_kept(x_row, keys_row, n, lse, threshold, need, b, BLOCK_S: tl.constexpr):
    """Keys 0..n-1 in order: keep P > T and the first `need` keys with P == T; write their
    positions compacted (ascending) to keys_row[0..b)."""
    _write_kept_range(x_row, keys_row, 0, n, lse, threshold, need, b, b * 0, b * 0, BLOCK_S)


@triton.jit
def _write_kept_range(x_row, keys_row, lo, hi, lse, threshold, need, b, kept, ties, BLOCK_S: tl.constexpr):
    """`_write_kept` over keys lo..hi-1, given `kept` keys kept and `ties` keys equal to T
    seen before lo; returns the kept count after hi."""
    for start in range(lo, hi, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        ok = j < hi
        x = _prob_bits(x_row, j, ok, lse)
        above = (ok & (x > threshold)).to(tl.int32)
        tie = (ok & (x == threshold)).to(tl.int32)
        # One scan for both counts: ties in the low 16 bits, keys above T in the high ones.
        packed = tie | (above << 16)
        both = tl.cumsum(packed, axis=0) - packed  # exclusive
        ties_before = both & 0xFFFF
        tie_ok = tie * ((ties + ties_before) < need).to(tl.int32)
        at = kept + (both >> 16) + tl.minimum(ties_before, tl.maximum(need - ties, 0))
        keep = (above | tie_ok) != 0
        tl.store(keys_row + at, j.to(tl.int32), mask=keep & (at < b))
        kept += tl.sum(above | tie_ok, axis=0)
        ties += tl.sum(tie, axis=0)
    return kept


@triton.jit
def _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, kv_head, stride_vs, stride_vh, n, lse, b,
               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
               first=0):
    """m = sum P and C_ref = sum P V over kept entries first..b-1 (all b by default; V
    through the page table)."""
    d = tl.arange(0, BLOCK_D)
    mass = tl.zeros([BLOCK_V], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(first, b, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < b
        j = tl.load(keys_row + i, mask=ok, other=0, cache_modifier=".cg")  # written by this program
        j = tl.where((j >= 0) & (j < n), j, 0).to(tl.int64)  # in bounds even for NaN scores
        p, _bits = _probs(x_row, j, ok, lse)
        page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + j % PAGE_SIZE
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        mass += p
        acc += tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return tl.sum(mass, axis=0), acc


@triton.jit
def _kept_sums_packed(
    x_row, keys_row, n, lse, b, pos, cell, depth, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr, first=0,
):
    """`_kept_sums` over INT4 residual planes: V of each kept key as the row at `pos` reads
    it (`_key_block`)."""
    mass = tl.zeros([BLOCK_V], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(first, b, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < b
        j = tl.load(keys_row + i, mask=ok, other=0, cache_modifier=".cg")  # written by this program
        j = tl.where((j >= 0) & (j < n), j, 0)  # in bounds even for NaN scores
        p, _bits = _probs(x_row, j.to(tl.int64), ok, lse)
        _k, v = _key_block(
            j, ok, cell, depth, pos, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr,
            k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks,
            stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_V,
            BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, 2)  # V alone
        mass += p
        acc += tl.sum(p[:, None] * v, axis=0)
    return tl.sum(mass, axis=0), acc


@triton.jit
def _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, at, b, mass, c_ref, count_ptr, mass_ptr,
                 o_ref_ptr, c_ref_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (row, head)'s state into its slot: O_ref = the dense output in fp32, C_ref, m, and
    (head 0) the count b."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dense = tl.load(dense_ptr + row * stride_dn + head * stride_dh + d, mask=d_ok, other=0.0)
    tl.store(o_ref_ptr + at * HEAD_DIM + d, dense.to(tl.float32), mask=d_ok)
    tl.store(c_ref_ptr + at * HEAD_DIM + d, c_ref, mask=d_ok)
    tl.store(mass_ptr + at, mass)
    if head == 0:
        tl.store(count_ptr + slot, b)


@triton.jit(do_not_specialize=["max_context"])
def _select_kernel(
    scratch_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, dense_ptr, lse_ptr,
    keys_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr,
    first, stride_xr, stride_xh, stride_vs, stride_vh, stride_dn, stride_dh, stride_ln, num_heads, capacity,
    max_context, num, den, k_ptr, stride_ks, stride_kh,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr,
    HAVE_LSE: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Per (row of the chunk, query head): lse (HAVE_LSE: the dense launch's), the exact
    top-b of P, and the slot's state. PACKED: V of the kept keys from INT4 residual planes
    (k / v their tails), as the row reads it."""
    r = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = first + r
    pos = tl.load(positions_ptr + row).to(tl.int64)
    if pos >= 0:
        n = tl.minimum(pos + 1, max_context)
        b = tl.minimum(n, tl.maximum((n * num + den - 1) // den, 1)).to(tl.int32)  # `key_budget`
        slot = tl.load(slots_ptr + row).to(tl.int64)
        x_row = scratch_ptr + r * stride_xr + head * stride_xh
        if HAVE_LSE:
            lse = tl.load(lse_ptr + row * stride_ln + head)
        else:
            lse = _row_lse(x_row, n, BLOCK_S)
        threshold, need = _radix_select(x_row, n, lse, b, BLOCK_S, RADIX_BITS)
        at = slot * num_heads + head
        keys_row = keys_ptr + at * capacity
        _write_kept(x_row, keys_row, n, lse, threshold, need, b, BLOCK_S)
        tl.debug_barrier()  # the kept positions, written above by other threads, are read below
        table = tl.load(offsets_ptr + row).to(tl.int64)
        if PACKED:
            mass, c_ref = _kept_sums_packed(
                x_row, keys_row, n, lse, b, pos.to(tl.int32), tl.load(cell_ptr + row).to(tl.int64),
                tl.load(depth_ptr + row).to(tl.int32), table, head // GROUP, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, num_heads // GROUP, max_groups, max_len, PAGE_SIZE,
                HEAD_DIM, BLOCK_V, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND)
        else:
            mass, c_ref = _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, head // GROUP, stride_vs, stride_vh,
                                     n, lse, b, PAGE_SIZE, HEAD_DIM, BLOCK_V, BLOCK_D)
        _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, at, b, mass, c_ref, count_ptr, mass_ptr,
                     o_ref_ptr, c_ref_ptr, HEAD_DIM, BLOCK_D)


# The select split over `splits` programs per (row, query head), for small batches, where
# one program per (row, head) leaves most of the GPU idle. Its rows' scores and lse come
# from the dense launch (`decode_select`); the launches share global per-digit histograms
# (a launch boundary orders each digit after the last), then the keys kept and tied per
# split, then the kept positions, then partial sums over shares of the kept list (balanced
# however the kept keys bunch along the row). Every program of a (row, head) derives the
# threshold from the histograms alone, so the kept set is the one-program select's.

@triton.jit
def _split_share(n, split, splits, BLOCK_S: tl.constexpr):
    """A split's keys lo..hi-1 of 0..n-1 (shares of whole blocks; late splits may be empty)."""
    share = tl.cdiv(tl.cdiv(n, splits), BLOCK_S) * BLOCK_S
    lo = split * share
    return lo, tl.minimum(n, lo + share)


@triton.jit
def _split_program(positions_ptr, max_context, num, den):
    """The program's row, head and split; its position, key count n (0 for a padding row)
    and budget b (`key_budget`)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    n = tl.maximum(tl.minimum(pos + 1, max_context), 0)
    b = tl.minimum(n, tl.maximum((n * num + den - 1) // den, 1)).to(tl.int32)
    return row, head, split, pos, n, b


@triton.jit
def _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num, den, splits, BLOCK_S: tl.constexpr):
    """`_split_program`, the row's lse and the split's key range."""
    row, head, split, pos, n, b = _split_program(positions_ptr, max_context, num, den)
    lse = tl.load(lse_ptr + row * stride_ln + head, mask=pos >= 0, other=0.0)
    lo, hi = _split_share(n, split, splits, BLOCK_S)
    return row, head, split, pos, n, b, lse, lo, hi


@triton.jit
def _threshold(hist_row, b, DIGIT: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(prefix, need) after the first DIGIT digits, from their global histograms."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    bins = tl.arange(0, BINS)
    need = b
    prefix = b * 0
    for digit in tl.static_range(DIGIT):
        prefix, need = _digit_step(tl.load(hist_row + digit * BINS + bins), bins, prefix, need,
                                   (DIGITS - 1 - digit) * RADIX_BITS)
    return prefix, need


@triton.jit(do_not_specialize=["max_context"])
def _split_digit_kernel(
    scratch_ptr, positions_ptr, lse_ptr, hist_ptr, stride_xr, stride_xh, stride_ln, num_heads, max_context, num,
    den, splits,
    DIGIT: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its keys' histogram of digit DIGIT among those matching the
    prefix the earlier digits fixed, added to the (row, head)'s global histogram."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        BINS: tl.constexpr = 1 << RADIX_BITS
        DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
        shift: tl.constexpr = (DIGITS - 1 - DIGIT) * RADIX_BITS
        hist_row = hist_ptr + (row * num_heads + head) * (DIGITS * BINS)
        prefix, _need = _threshold(hist_row, b, DIGIT, RADIX_BITS)
        x_row = scratch_ptr + row * stride_xr + head * stride_xh
        hist = tl.zeros([BINS], tl.int32)
        for start in range(lo, hi, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < hi
            x = _prob_bits(x_row, j, ok, lse)
            if DIGIT > 0:
                ok = ok & ((x >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
            hist += tl.histogram((x >> shift) & (BINS - 1), BINS, mask=ok)
        tl.atomic_add(hist_row + DIGIT * BINS + tl.arange(0, BINS), hist)


@triton.jit
def _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr, stride_xh,
                     RADIX_BITS: tl.constexpr):
    """The threshold T and `need` from every digit's global histogram of a (row, head), and
    its scores row."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    threshold, need = _threshold(hist_ptr + (row * num_heads + head) * (DIGITS * BINS), b, DIGITS, RADIX_BITS)
    return threshold, need, scratch_ptr + row * stride_xr + head * stride_xh


@triton.jit(do_not_specialize=["max_context"])
def _split_count_kernel(
    scratch_ptr, positions_ptr, lse_ptr, hist_ptr, counts_ptr, stride_xr, stride_xh, stride_ln, num_heads,
    max_context, num, den, splits,
    BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): how many of its keys lie above the threshold T and equal it."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        threshold, _need, x_row = _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr, stride_xh,
                                               RADIX_BITS)
        above = b * 0
        ties = b * 0
        for start in range(lo, hi, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < hi
            x = _prob_bits(x_row, j, ok, lse)
            above += tl.sum((ok & (x > threshold)).to(tl.int32), axis=0)
            ties += tl.sum((ok & (x == threshold)).to(tl.int32), axis=0)
        at = ((row * num_heads + head) * splits + split) * 2
        tl.store(counts_ptr + at, above)
        tl.store(counts_ptr + at + 1, ties)


@triton.jit(do_not_specialize=["max_context"])
def _split_write_kernel(
    scratch_ptr, positions_ptr, slots_ptr, lse_ptr, hist_ptr, counts_ptr, keys_ptr, stride_xr, stride_xh,
    stride_ln, num_heads, capacity, max_context, num, den, splits,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its kept keys' positions, at the offset the earlier splits'
    counts give."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        threshold, need, x_row = _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr,
                                                  stride_xh, RADIX_BITS)
        i = tl.arange(0, BLOCK_P)
        earlier = i < split  # earlier splits are never empty: shares are cut from key 0
        at = ((row * num_heads + head) * splits + i) * 2
        above_before = tl.sum(tl.load(counts_ptr + at, mask=earlier, other=0), axis=0)
        ties_before = tl.sum(tl.load(counts_ptr + at + 1, mask=earlier, other=0), axis=0)
        first = above_before + tl.minimum(ties_before, need)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        keys_row = keys_ptr + (slot * num_heads + head) * capacity
        _write_kept_range(x_row, keys_row, lo, hi, lse, threshold, need, b, first, ties_before, BLOCK_S)


@triton.jit(do_not_specialize=["max_context"])
def _split_gather_kernel(
    scratch_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, lse_ptr, part_ptr, keys_ptr,
    stride_xr, stride_xh, stride_vs, stride_vh, stride_ln, num_heads, capacity, max_context, num, den, splits,
    k_ptr, stride_ks, stride_kh,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Per (row, head, split): m and C_ref summed over the split's share of the b kept
    entries (shares of the kept list, not of the keys: kept keys bunched in a few key
    ranges, as recent keys and sinks are, still spread over every split) into its partial
    [1 + D]. PACKED: V of the kept keys from INT4 residual planes (k / v their tails), as
    the row reads it."""
    row, head, split, pos, n, b = _split_program(positions_ptr, max_context, num, den)
    lo, hi = _split_share(b, split, splits, BLOCK_V)
    if lo < hi:
        lse = tl.load(lse_ptr + row * stride_ln + head)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        keys_row = keys_ptr + (slot * num_heads + head) * capacity
        x_row = scratch_ptr + row * stride_xr + head * stride_xh
        table = tl.load(offsets_ptr + row).to(tl.int64)
        if PACKED:
            mass, c_ref = _kept_sums_packed(
                x_row, keys_row, n, lse, hi, pos.to(tl.int32), tl.load(cell_ptr + row).to(tl.int64),
                tl.load(depth_ptr + row).to(tl.int32), table, head // GROUP, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, num_heads // GROUP, max_groups, max_len, PAGE_SIZE,
                HEAD_DIM, BLOCK_V, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, first=lo)
        else:
            mass, c_ref = _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, head // GROUP, stride_vs,
                                     stride_vh, n, lse, hi, PAGE_SIZE, HEAD_DIM, BLOCK_V, BLOCK_D, first=lo)
        part = part_ptr + ((row * num_heads + head) * splits + split) * (1 + HEAD_DIM)
        d = tl.arange(0, BLOCK_D)
        tl.store(part, mass)
        tl.store(part + 1 + d, c_ref, mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["max_context"])
def _split_finish_kernel(
    positions_ptr, slots_ptr, dense_ptr, part_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, stride_dn, stride_dh,
    num_heads, max_context, num, den, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Per (row, head): m and C_ref from the gather's splits that held kept entries, O_ref,
    and the count."""
    row, head, _split, pos, n, b = _split_program(positions_ptr, max_context, num, den)  # grid (rows, heads)
    if pos >= 0:
        i = tl.arange(0, BLOCK_P)
        lo, _hi = _split_share(b, i, splits, BLOCK_V)  # `_split_gather_kernel`'s shares
        ran = (i < splits) & (lo < b)
        part = part_ptr + ((row * num_heads + head) * splits + i) * (1 + HEAD_DIM)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        mass = tl.sum(tl.load(part, mask=ran, other=0.0), axis=0)
        c_ref = tl.sum(tl.load(part[:, None] + 1 + d[None, :], mask=ran[:, None] & d_ok[None, :], other=0.0), axis=0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, slot * num_heads + head, b, mass, c_ref,
                     count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, HEAD_DIM, BLOCK_D)


@triton.jit
def _kept_block(start, keys_row, count, g_ok, table, kv_head, tables_ptr, cache_ptr, stride_s, stride_h, full,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Kept keys start..start+BLOCK_N of each head (`keys_row` [G] pointers; every key in
    order when `full`; ok: a real entry [G, BLOCK_N]) and their rows of `cache` through the
    row's page table, fp32 [G, BLOCK_N, BLOCK_D]."""
    i = start + tl.arange(0, BLOCK_N)
    ok = g_ok[:, None] & (i[None, :] < count)
    kept = (i[None, :] * 0 + full.to(tl.int32)) == 0  # (a tensor: the interpreter cannot mask by a scalar)
    j = tl.load(keys_row[:, None] + i[None, :], mask=ok & kept, other=0)
    j = tl.where(full, i[None, :], j).to(tl.int64)
    page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, :, None] & (d < HEAD_DIM)[None, None, :]
    x = tl.load(cache_ptr + slot[:, :, None] * stride_s + kv_head * stride_h + d[None, None, :], mask=mask, other=0.0)
    return ok, x.to(tl.float32)


@triton.jit
def _kept_packed_block(
    start, keys_row, count, g_ok, full, pos, cell, depth, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """`_kept_block` for K and V at once over INT4 residual planes: each head's kept keys
    (ok [G, BLOCK_N]) read as the row at `pos` reads them, fp32 [G, BLOCK_N, BLOCK_D] each.
    The heads' positions are gathered as one vector of G x BLOCK_N keys (`_key_block` works
    key by key, so the positions need not be contiguous)."""
    i = start + tl.arange(0, BLOCK_N)
    ok = g_ok[:, None] & (i[None, :] < count)
    kept = (i[None, :] * 0 + full.to(tl.int32)) == 0  # (a tensor: the interpreter cannot mask by a scalar)
    j = tl.load(keys_row[:, None] + i[None, :], mask=ok & kept, other=0)
    j = tl.where(full, i[None, :], j)
    k, v = _key_block(
        tl.reshape(j, [BLOCK_G * BLOCK_N]), tl.reshape(ok, [BLOCK_G * BLOCK_N]), cell, depth, pos, table, kv_head,
        k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
        seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads,
        max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_G * BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND)
    return ok, tl.reshape(k, [BLOCK_G, BLOCK_N, BLOCK_D]), tl.reshape(v, [BLOCK_G, BLOCK_N, BLOCK_D])


@triton.jit
def _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS: tl.constexpr):
    """A correction row's slot, whether it runs dense (its state missing) and its key count
    (the slot's b, or pos + 1 for a dense row)."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    full = pos < 0  # False, as a tensor
    if HAS_DENSE_ROWS:
        full = tl.load(dense_rows_ptr + row) != 0
    count = tl.where(full, pos + 1, tl.load(count_ptr + slot))  # (a decode slot: in bounds)
    return slot, full, count


@triton.jit
def _correction_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, keys_ptr, count_ptr, mass_ptr,
    o_ref_ptr, c_ref_ptr, out_ptr, part_ptr, stats_ptr, dense_rows_ptr, stride_qn, stride_qh, stride_ks, stride_kh,
    stride_vs, stride_vh, stride_on, stride_oh, num_heads, capacity, splits, scale,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr, DIRECT: tl.constexpr,
    HAS_DENSE_ROWS: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
):
    """Per (row, KV head, split): an online softmax of q_r . K_r over the split's share of
    each head's kept keys. DIRECT (one split): corrected by the slot's state into out (in
    place); otherwise the split's running max, sum and unnormalised sum of p V go to the
    partials for `_combine_kernel`. A dense row (`dense_rows`: its state is missing) runs
    over its keys 0..pos and reads nothing of the state. PACKED: k / v are INT4 residual
    planes' BF16 tails and each kept key is read as the row reads it, exact from the tail or
    reconstructed from the packed records (the packed reader's gather, `_key_block`)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + row)
    if pos >= 0:
        slot, full, count = _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS)
        if count > 0:
            lo, hi = _split_share(count, split, splits, BLOCK_N)
            table = tl.load(offsets_ptr + row).to(tl.int64)
            g = tl.arange(0, BLOCK_G)
            g_ok = g < GROUP
            head = kv_head * GROUP + g
            at = slot * num_heads + head
            keys_row = keys_ptr + at * capacity
            d = tl.arange(0, BLOCK_D)
            ok_gd = g_ok[:, None] & (d < HEAD_DIM)[None, :]
            q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :], mask=ok_gd, other=0.0)
            q = q.to(tl.float32)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            cell = row * 0
            depth = kv_head * 0
            if PACKED:
                cell = tl.load(cell_ptr + row).to(tl.int64)
                depth = tl.load(depth_ptr + row).to(tl.int32)
            for start in range(lo, hi, BLOCK_N):
                if PACKED:
                    ok, k, v = _kept_packed_block(
                        start, keys_row, hi, g_ok, full, pos.to(tl.int32), cell, depth, table, kv_head, k_ptr,
                        v_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
                        seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                        num_heads // GROUP, max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_G, BLOCK_N, BLOCK_D,
                        PLANES, V_GROUPS, BF16_BY_HAND)
                else:
                    ok, k = _kept_block(start, keys_row, hi, g_ok, table, kv_head, tables_ptr, k_ptr, stride_ks,
                                        stride_kh, full, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
                    _ok, v = _kept_block(start, keys_row, hi, g_ok, table, kv_head, tables_ptr, v_ptr, stride_vs,
                                         stride_vh, full, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
                s = tl.sum(q[:, None, :] * k, axis=2) * scale  # [G, BLOCK_N], fp32 products
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads see no key
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
                m_i = m_new
            if DIRECT:
                local = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                _write_corrected(local, at, row, head, g_ok, ok_gd, d, full, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr,
                                 stride_on, stride_oh, HEAD_DIM, BF16_BY_HAND)
            else:
                part = (row * num_heads + head) * splits + split  # [G] partial rows
                tl.store(stats_ptr + part * 2, m_i, mask=g_ok)
                tl.store(stats_ptr + part * 2 + 1, l_i, mask=g_ok)
                tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=ok_gd)


@triton.jit
def _write_corrected(local, at, row, head, g_ok, ok_gd, d, full, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr,
                     stride_on, stride_oh, HEAD_DIM: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """out[row, head] = O_ref - C_ref + m * local (a dense row: local), rounded once to
    out's dtype."""
    vec = at[:, None] * HEAD_DIM + d[None, :]
    state = (at * 0 + full.to(tl.int32)) == 0  # [G] (a tensor: the interpreter cannot mask by a scalar)
    o_ref = tl.load(o_ref_ptr + vec, mask=ok_gd & state[:, None], other=0.0)
    c_ref = tl.load(c_ref_ptr + vec, mask=ok_gd & state[:, None], other=0.0)
    mass = tl.load(mass_ptr + at, mask=g_ok & state, other=1.0)
    o = round_to(o_ref - c_ref + mass[:, None] * local, out_ptr.dtype.element_ty, BF16_BY_HAND)
    tl.store(out_ptr + row * stride_on + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=ok_gd)


@triton.jit
def _combine_kernel(
    positions_ptr, slots_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr, part_ptr, stats_ptr,
    dense_rows_ptr, stride_on, stride_oh, num_heads, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, HAS_DENSE_ROWS: tl.constexpr,
):
    """Per (row, query head): merges the splits' partial softmaxes (splits whose share is
    empty wrote nothing and are skipped) and writes the corrected output."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions_ptr + row)
    if pos >= 0:
        slot, full, count = _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS)
        if count > 0:
            i = tl.arange(0, BLOCK_P)
            d = tl.arange(0, BLOCK_D)
            part = (row * num_heads + head) * splits + i
            first, _last = _split_share(count, i, splits, BLOCK_N)  # `_correction_kernel`'s shares
            ran = (i < splits) & (first < count)  # a split ran iff its share holds a kept key
            m = tl.load(stats_ptr + part * 2, mask=ran, other=float("-inf"))
            l = tl.load(stats_ptr + part * 2 + 1, mask=ran, other=0.0)
            acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                          mask=ran[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
            top = tl.max(m, axis=0)
            w = tl.where(ran, tl.exp(m - top), 0.0)
            local = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
            at = slot * num_heads + head
            ok_d = d < HEAD_DIM
            _write_corrected(local[None, :], at + tl.zeros([1], tl.int64), row, head + tl.zeros([1], tl.int32),
                             tl.full([1], True, tl.int1), ok_d[None, :], d, full, mass_ptr, o_ref_ptr, c_ref_ptr,
                             out_ptr, stride_on, stride_oh, HEAD_DIM, BF16_BY_HAND)


# --- launchers ------------------------------------------------------------------------

def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           positions: torch.Tensor, table_offsets: torch.Tensor, slots: torch.Tensor, state: SlotState) -> None:
    """Layout assertions (no host sync: shapes, dtypes and strides only)."""
    n, num_heads, head_dim = q.shape
    assert q.dtype in DTYPES, f"sparse decode kernels take {', '.join(map(str, DTYPES))}, not {q.dtype}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, "K and V caches must be [S, Hkv, D]"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q and the caches share the model dtype"
    assert num_heads % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    assert positions.shape == table_offsets.shape == slots.shape == (n,), "positions, table offsets, slots: [N]"
    for t in (tables, positions, table_offsets, slots):
        assert t.is_contiguous() and not t.is_floating_point(), "tables, positions, offsets, slots: contiguous ints"
    num_slots, capacity = state.keys.shape[0], state.keys.shape[2]
    shapes = {"keys": (num_slots, num_heads, capacity), "count": (num_slots,), "mass": (num_slots, num_heads),
              "o_ref": (num_slots, num_heads, head_dim), "c_ref": (num_slots, num_heads, head_dim)}
    for name, shape in shapes.items():
        t = getattr(state, name)
        assert t.shape == shape and t.is_contiguous(), f"state.{name}: contiguous {list(shape)}"
    assert state.keys.dtype == state.count.dtype == torch.int32, "state keys and count: int32"
    assert state.mass.dtype == state.o_ref.dtype == state.c_ref.dtype == torch.float32, "the kernels' state: fp32"


def _shape(num_heads: int, cache: torch.Tensor, page_size: int) -> dict:
    head_dim = cache.shape[2]
    return dict(PAGE_SIZE=page_size, GROUP=num_heads // cache.shape[1], HEAD_DIM=head_dim,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


def source_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                  *, dense: torch.Tensor, slots: torch.Tensor, state: SlotState, max_context: int,
                  scratch: torch.Tensor | None = None, blocks: Blocks = Blocks(),
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state on the device: per chunk of scratch rows, the scores kernel then the
    select kernel; no host sync, a fixed launch sequence for fixed shapes (CUDA graphs).
    max_context (static, > every position) bounds the keys and the budgets that the state's
    capacity must cover (checked here from Python ints). `packed`: the caches are INT4
    residual planes' tails (`PackedRows`)."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets, slots, state)
    n, num_heads, head_dim = q.shape
    capacity = state.keys.shape[2]
    check_capacity(max_context, key_retention, capacity)
    assert dense.shape == q.shape and dense.dtype == q.dtype and dense.stride(2) == 1, "dense: [N, Hq, D] in q's dtype"
    _check_blocks(blocks)
    if n == 0:
        return
    if scratch is None:
        rows = min(n, scratch_rows(num_heads, max_context, SCRATCH_BYTES))
        scratch = torch.empty(rows, num_heads, scratch_keys(max_context), dtype=torch.float32, device=q.device)
    assert (scratch.dtype == torch.float32 and scratch.dim() == 3 and scratch.shape[1] == num_heads
            and scratch.shape[2] >= max_context and scratch.stride(2) == 1), "scratch: fp32 [rows, Hq, >= max_context]"
    chunk = scratch.shape[0]
    splits = blocks.splits or score_splits(min(n, chunk), k_cache.shape[1], max_context, _num_sms(q.device))
    for first in range(0, n, chunk):
        rows = min(chunk, n - first)
        _launch_scores(q, k_cache, v_cache, tables, positions, table_offsets, page_size, scratch, first, rows,
                       max_context, splits, blocks, packed)
        _launch_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, slots, state,
                       scratch, first, rows, max_context, blocks, k_cache=k_cache, packed=packed)


def decode_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                  table_offsets: torch.Tensor, page_size: int, key_retention: float, *, dense: torch.Tensor,
                  lse: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, state: SlotState,
                  max_context: int, blocks: Blocks = Blocks(), k_cache: torch.Tensor | None = None,
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state from a dense launch that kept the rows' scores and lse (Triton only):
    `paged_attention(..., scores=scores, score_rows=..., return_lse=True)` (or
    `packed_attention`'s) stored row i's scaled scores in scores[i] (i-th row here) and gave
    `lse` [N, Hq] and `dense`; this runs the select kernel alone, which is `decode_source`
    without its scores kernel and lse pass. scores [>= N, Hq, >= max_context] fp32; the rest
    as `decode_source`. `packed` (with the K tail `k_cache`): V of the kept keys from INT4
    residual planes, as each row reads it."""
    n, num_heads, head_dim = dense.shape
    assert positions.shape == table_offsets.shape == slots.shape == (n,), "positions, table offsets, slots: [N]"
    assert lse.shape == (n, num_heads) and lse.dtype == torch.float32 and lse.stride(1) == 1, "lse: fp32 [N, Hq]"
    assert (scores.dtype == torch.float32 and scores.dim() == 3 and scores.shape[0] >= n
            and scores.shape[1] == num_heads and scores.shape[2] >= max_context and scores.stride(2) == 1), (
        "scores: fp32 [>= N, Hq, >= max_context]")
    assert dense.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    check_capacity(max_context, key_retention, state.keys.shape[2])
    _check_blocks(blocks)
    if n == 0:
        return
    splits = blocks.select_splits or select_splits(n, num_heads, max_context, _num_sms(dense.device),
                                                   blocks.split_select)
    if splits == 1:
        _launch_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, slots, state,
                       scores, 0, n, max_context, blocks, lse=lse, k_cache=k_cache, packed=packed)
    else:
        _launch_split_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, lse,
                             scores, slots, state, max_context, splits, blocks, k_cache, packed)


def _check_blocks(blocks: Blocks) -> None:
    assert 16 <= blocks.scores and 32 <= min(blocks.select, blocks.split_select) and max(
        blocks.select, blocks.split_select) <= 1 << 15, (
        "scores blocks feed tl.dot; select blocks count in 16 bits and hold at least a warp's 32 keys (Triton "
        "3.6 on the H200 miscounted 16-key blocks)")


def _launch_split_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                         table_offsets: torch.Tensor, page_size: int, key_retention: float, dense: torch.Tensor,
                         lse: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, state: SlotState,
                         max_context: int, splits: int, blocks: Blocks, k_cache: torch.Tensor | None = None,
                         packed: PackedRows | None = None) -> None:
    """The select split over `splits` programs per (row, head): one histogram launch per
    digit, the kept and tied counts per split, the kept keys, their partial sums over
    shares of the kept list (`packed`: V from INT4 residual planes), and the finish (no
    host sync; a fixed launch sequence for fixed shapes)."""
    n, num_heads, head_dim = dense.shape
    num, den = retention_fraction(key_retention)
    bins = 1 << blocks.radix_bits
    digits = -(-PATTERN_BITS // blocks.radix_bits)
    hist = torch.zeros(n * num_heads * digits * bins, dtype=torch.int32, device=dense.device)
    counts = torch.empty(n * num_heads * splits * 2, dtype=torch.int32, device=dense.device)
    part = torch.empty(n * num_heads * splits * (1 + head_dim), dtype=torch.float32, device=dense.device)
    grid = (n, num_heads, splits)
    common = (scores.stride(0), scores.stride(1))
    for digit in range(digits):
        _split_digit_kernel[grid](scores, positions, lse, hist, *common, lse.stride(0), num_heads, max_context, num,
                                  den, splits, DIGIT=digit, BLOCK_S=blocks.split_select, RADIX_BITS=blocks.radix_bits,
                                  num_warps=blocks.select_warps)
    _split_count_kernel[grid](scores, positions, lse, hist, counts, *common, lse.stride(0), num_heads, max_context,
                              num, den, splits, BLOCK_S=blocks.split_select, RADIX_BITS=blocks.radix_bits,
                              num_warps=blocks.select_warps)
    block_p = max(2, triton.next_power_of_2(splits))
    _split_write_kernel[grid](scores, positions, slots, lse, hist, counts, state.keys, *common, lse.stride(0),
                              num_heads, state.keys.shape[2], max_context, num, den, splits,
                              BLOCK_S=blocks.split_select, BLOCK_P=block_p, RADIX_BITS=blocks.radix_bits,
                              num_warps=blocks.select_warps)
    shape = _shape(num_heads, v_cache, page_size)
    planes, extra = packed.kernel_args(n, head_dim) if packed is not None else PackedRows.no_args(positions)
    k_cache = v_cache if k_cache is None else k_cache
    _split_gather_kernel[grid](scores, v_cache, tables, positions, table_offsets, slots, lse, part, state.keys,
                               *common, v_cache.stride(0), v_cache.stride(1), lse.stride(0), num_heads,
                               state.keys.shape[2], max_context, num, den, splits, k_cache, k_cache.stride(0),
                               k_cache.stride(1), *planes, BLOCK_V=blocks.gather,
                               BF16_BY_HAND=_INTERPRET and dense.dtype == torch.bfloat16, **shape,
                               num_warps=blocks.select_warps, **extra)
    _split_finish_kernel[(n, num_heads)](positions, slots, dense, part, state.count, state.mass, state.o_ref,
                                         state.c_ref, dense.stride(0), dense.stride(1), num_heads, max_context, num,
                                         den, splits, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"],
                                         BLOCK_V=blocks.gather, BLOCK_P=block_p)


def _launch_scores(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, scratch: torch.Tensor,
                   first: int, rows: int, max_context: int, splits: int, blocks: Blocks,
                   packed: PackedRows | None = None) -> None:
    """The scores kernel over rows first..first+rows-1 into scratch rows 0..rows-1."""
    shape = _shape(q.shape[1], k_cache, page_size)
    planes, extra = (packed.kernel_args(q.shape[0], q.shape[2]) if packed is not None
                     else PackedRows.no_args(positions))
    _scores_kernel[(rows, k_cache.shape[1], splits)](
        q, k_cache, tables, positions, table_offsets, scratch,
        first, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), scratch.stride(0), scratch.stride(1),
        max_context, splits, q.shape[2] ** -0.5, v_cache, v_cache.stride(0), v_cache.stride(1), k_cache.shape[1],
        *planes, BLOCK_M=max(16, triton.next_power_of_2(shape["GROUP"])), BLOCK_N=blocks.scores,
        DOT_FP32=_INTERPRET or q.dtype == torch.float32, BF16_BY_HAND=_INTERPRET and q.dtype == torch.bfloat16,
        **shape, **extra,
    )


def _launch_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                   table_offsets: torch.Tensor, page_size: int, key_retention: float, dense: torch.Tensor,
                   slots: torch.Tensor, state: SlotState, scratch: torch.Tensor, first: int, rows: int,
                   max_context: int, blocks: Blocks, lse: torch.Tensor | None = None,
                   k_cache: torch.Tensor | None = None, packed: PackedRows | None = None) -> None:
    """The select kernel over rows first..first+rows-1, whose scores are in scratch rows
    0..rows-1 (and whose lse [N, Hq], when given, is the dense launch's). `packed` (with the
    K tail `k_cache`): V from INT4 residual planes."""
    num_heads = dense.shape[1]
    num, den = retention_fraction(key_retention)
    planes, extra = (packed.kernel_args(dense.shape[0], dense.shape[2]) if packed is not None
                     else PackedRows.no_args(positions))
    k_cache = v_cache if k_cache is None else k_cache
    _select_kernel[(rows, num_heads)](
        scratch, v_cache, tables, positions, table_offsets, slots, dense, dense if lse is None else lse,
        state.keys, state.count, state.mass, state.o_ref, state.c_ref,
        first, scratch.stride(0), scratch.stride(1), v_cache.stride(0), v_cache.stride(1), dense.stride(0),
        dense.stride(1), 0 if lse is None else lse.stride(0), num_heads, state.keys.shape[2], max_context, num, den,
        k_cache, k_cache.stride(0), k_cache.stride(1), *planes,
        BLOCK_S=blocks.select, BLOCK_V=blocks.gather, RADIX_BITS=blocks.radix_bits,
        HAVE_LSE=lse is not None, BF16_BY_HAND=_INTERPRET and dense.dtype == torch.bfloat16,
        **_shape(num_heads, v_cache, page_size), num_warps=blocks.select_warps, **extra,
    )


def correction_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                      slots: torch.Tensor, state: SlotState, out: torch.Tensor, blocks: Blocks = Blocks(),
                      dense_rows: torch.Tensor | None = None, packed: PackedRows | None = None) -> None:
    """Loop >= 3 outputs into `out` in place: programs per (row, KV head, split) over shares
    of the slot's kept keys (a `dense_rows` row: of its keys 0..pos), then (more than one
    split) a combine per (row, query head); no host sync, a fixed launch sequence for fixed
    shapes. `packed`: the caches are INT4 residual planes' tails (`PackedRows`)."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets, slots, state)
    n, num_heads, head_dim = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: [N, Hq, D] in q's dtype"
    if n == 0:
        return
    shape = _shape(num_heads, k_cache, page_size)
    capacity = state.keys.shape[2]
    splits = blocks.correction_splits or correction_splits(n, k_cache.shape[1], capacity, _num_sms(q.device))
    direct = splits == 1
    part = q.new_empty((1 if direct else n * num_heads * splits, head_dim), dtype=torch.float32)
    stats = q.new_empty((1 if direct else n * num_heads * splits, 2), dtype=torch.float32)
    by_hand = _INTERPRET and q.dtype == torch.bfloat16
    has_dense = dense_rows is not None
    if has_dense:
        assert dense_rows.shape == (n,) and dense_rows.is_contiguous(), "dense_rows: [N]"
        dense_rows = dense_rows.view(torch.uint8) if dense_rows.dtype == torch.bool else dense_rows
    planes, extra = packed.kernel_args(n, head_dim) if packed is not None else PackedRows.no_args(positions)
    _correction_kernel[(n, k_cache.shape[1], splits)](
        q, k_cache, v_cache, tables, positions, table_offsets, slots, state.keys, state.count, state.mass,
        state.o_ref, state.c_ref, out, part, stats, dense_rows if has_dense else positions, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        num_heads, capacity, splits, head_dim ** -0.5, *planes, BLOCK_G=triton.next_power_of_2(shape["GROUP"]),
        BLOCK_N=blocks.correction, BF16_BY_HAND=by_hand, DIRECT=direct, HAS_DENSE_ROWS=has_dense, **shape, **extra,
    )
    if not direct:
        _combine_kernel[(n, num_heads)](
            positions, slots, state.count, state.mass, state.o_ref, state.c_ref, out, part, stats,
            dense_rows if has_dense else positions, out.stride(0), out.stride(1), num_heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"], BLOCK_N=blocks.correction,
            BLOCK_P=triton.next_power_of_2(splits), BF16_BY_HAND=by_hand, HAS_DENSE_ROWS=has_dense,
        )


# --- dispatch -------------------------------------------------------------------------

def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Triton on CUDA tensors or under TRITON_INTERPRET=1 by default (the kernels' dtypes
    only: fp64 goes to the reference); the reference otherwise."""
    if use_triton is None:
        return (x.is_cuda or _INTERPRET) and x.dtype in DTYPES
    assert not use_triton or x.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    return use_triton


def decode_source(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float, *,
                  dense: torch.Tensor, slots: torch.Tensor, state: SlotState, max_context: int,
                  scratch: torch.Tensor | None = None, use_triton: bool | None = None,
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state of the rows into their slots (module docstring); checks the capacity
    against max_context on the host from Python ints before either implementation runs.
    `packed`: the caches and tables are INT4 residual planes' tails, and each key is read
    as the row reads it (`PackedRows`)."""
    check_capacity(max_context, key_retention, state.keys.shape[2])
    if _use_triton(q, use_triton):
        source_triton(q, k_cache, v_cache, tables, positions, table_offsets, page_size, key_retention, dense=dense,
                      slots=slots, state=state, max_context=max_context, scratch=scratch, packed=packed)
        return
    if packed is not None:  # the reference reads the rows' keys into a paged copy first
        k_cache, v_cache, tables, table_offsets, page_size = packed.gather(k_cache, v_cache, tables, positions,
                                                                           table_offsets, page_size)
    source_reference(q, k_cache, v_cache, tables, positions, table_offsets, page_size, key_retention, dense=dense,
                     slots=slots, state=state, max_context=max_context)


def decode_correction(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                      slots: torch.Tensor, state: SlotState, out: torch.Tensor,
                      use_triton: bool | None = None, dense_rows: torch.Tensor | None = None,
                      packed: PackedRows | None = None) -> None:
    """Loop >= 3 outputs of the rows from their slots' state, into `out` in place (module
    docstring); rows set in `dense_rows` ([N] bool: a missing state) get dense attention
    over their keys 0..pos at that depth instead. `packed`: the caches and tables are INT4
    residual planes' tails, and each key is read as the row reads it (`PackedRows`)."""
    if _use_triton(q, use_triton):
        correction_triton(q, k_cache, v_cache, tables, positions, table_offsets, page_size, slots=slots, state=state,
                          out=out, dense_rows=dense_rows, packed=packed)
        return
    if packed is not None:  # the reference reads the rows' keys into a paged copy first
        k_cache, v_cache, tables, table_offsets, page_size = packed.gather(k_cache, v_cache, tables, positions,
                                                                           table_offsets, page_size)
    correction_reference(q, k_cache, v_cache, tables, positions, table_offsets, page_size, slots=slots, state=state,
                         out=out, dense_rows=dense_rows)
