"""Sparse decode attention (FlashLoop RFC 3.2): the method, and what its kernel families
share: the state in token slots (`SlotState`), the key budgets, the static tuning
(`Blocks`), the INT4 residual planes' launch arguments (`PackedRows`), the layout checks and
the helpers more than one family uses. The families, each a module whose Triton launchers
sit beside their torch reference:

- `sparse_decode_source`: loop 2, the scores kernel, `decode_source`, `decode_select`;
- `sparse_decode_select`: the exact top-b select, one program per (row, query head);
- `sparse_decode_split_select`: the same select split over several programs per (row, head);
- `sparse_decode_correction`: loops >= 3, `decode_correction`.

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
- What `decode_source` and `decode_correction` write: their modules' docstrings.

Budgets. key_retention is read as the decimal it prints as, num / den =
Fraction(repr(float(key_retention))), and b = min(n, max(1, (n * num + den - 1) // den)) in
integers: 0.1 * 30 is 3 keys, where the float product 3.0000000000000004 would round up to
4. The select kernel computes b from (num, den) in int64; `check_capacity` checks
max_context * num + den - 1 < 2^63 on the host so it cannot overflow: a retention of a few
decimal digits allows any context, 1/3 printed as 0.3333333333333333 about 2,700 keys, and a
longer context raises ValueError.

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
in fp32; fp32 inputs use IEEE fp32 products); the V gathers of the select and both gathers
of the correction multiply and reduce in fp32 on CUDA cores (their M dimension is one head).
Outputs are rounded once to DT. Under `TRITON_INTERPRET=1` tiles are cast to fp32 before
`tl.dot` (the interpreter's bf16 dot is wrong) and bf16 outputs are rounded by hand
(`rounding.round_to`), see ../shared/docs/gpu.md.

INT4 residual planes. `decode_source` and `decode_correction` take `packed=PackedRows(...)`:
their caches and tables are then the planes' BF16 tails, and each key is read as the row
reads it by the packed reader's own gather (`packed_keys._key_block`, key by key: the
scores kernel over keys 0..pos, the select's V sums and the correction on the kept
positions alone), launched without FMA contraction like that reader so the reconstruction
rounds the same way; the scores kernel decodes K alone, the V sums V alone. The
references read the rows' keys into a paged copy
(`read_keys_reference`) and run from it. `decode_select` takes `packed` too: the packed
reader keeps the source rows' scores and lse as the paged kernel does
(`packed_attention(..., scores=, score_rows=)`), and the select (one program or split)
sums V of the kept keys from the planes.
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES
from specloop.kernels.packed_keys import PackedKV, read_keys_reference

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
    seal, exact from the tail otherwise (`specloop.kernels.packed_keys`)."""

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


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


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


# --- shared by the torch references ---------------------------------------------------

def _row_slots(tables: torch.Tensor, offset: int, keys: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of a row's keys (any shape of positions >= 0)."""
    keys = keys.long()
    return tables[offset + keys // page_size].long() * page_size + keys % page_size


def _per_head_kv(cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """cache [Spool, Hkv, D] at per-head slots [Hq, b] -> [Hq, b, D] (query head h reads KV
    head h // group)."""
    kv_head = torch.arange(num_heads, device=slots.device) // (num_heads // cache.shape[1])
    return cache[slots, kv_head[:, None]]


# --- shared by the Triton kernels -----------------------------------------------------

@triton.jit
def _split_share(n, split, splits, BLOCK_S: tl.constexpr):
    """A split's keys lo..hi-1 of 0..n-1 (shares of whole blocks; late splits may be empty)."""
    share = tl.cdiv(tl.cdiv(n, splits), BLOCK_S) * BLOCK_S
    lo = split * share
    return lo, tl.minimum(n, lo + share)


# --- shared by the launchers ----------------------------------------------------------

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


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Triton on CUDA tensors or under TRITON_INTERPRET=1 by default (the kernels' dtypes
    only: fp64 goes to the reference); the reference otherwise."""
    if use_triton is None:
        return (x.is_cuda or _INTERPRET) and x.dtype in DTYPES
    assert not use_triton or x.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    return use_triton
