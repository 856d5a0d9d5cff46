"""Attention over K/V read exact from BF16 tail pages or reconstructed from INT4 residual
groups (FlashLoop's packed planes), in Triton, with its torch reference. It reads keys by
the rule, and with the Triton gather helpers, of `packed_keys` (which sparse decode shares;
the planes' layouts, `PackedKV`, are described there).

    packed = PackedKV(k_groups, v_groups, record_seal, group_tables, row_maps)
    out, lse = packed_attention(q, k_tail, v_tail, tables, page_size, packed,
                                cell, depth, position, table_offset, return_lse=True)
    # or in query tiles (prompt chunks, verifications: rows sharing each key block's gather)
    out, _ = packed_attention(..., table_offset, tiles=tiles, tile_rows=64)

What a call reads (one layer; the caller slices layers), besides the packed planes and the
BF16 tail with its page tables (`packed_keys`). DT is the model dtype (fp32, bf16 or fp16),
Hkv KV heads, Hq query heads (a multiple of Hkv), D the head dim (even).

- Query rows q [N, Hq, D] in DT, already rotated, each with its cell, depth d (a plane),
  position and table offset. A row with a negative position is padding: not written.
- Optionally query tiles, `tiles` [M, 3] int (first row, rows, table offset) as in
  `paged_attention`: up to `tile_rows` consecutive rows of one cell, depth and table offset
  (positions need not be consecutive or sorted: each row is causal by its own position);
  tiles of 0 rows are padding, and rows no tile covers are not written. The kernel reads
  cell and depth from a tile's first row and the table offset from the tile (the reference
  asserts that the rows agree, `tile_rows_covered`). Without tiles, each row is a tile.

Each row reads its keys j <= its position by the read rule (`packed_keys`: reconstructed
once the position has passed the key's seal, exact from the tail before). Then causal
attention by position: scores (q . k_j) * D^-0.5 and softmax in fp32,
out = sum_j p_j v_j in DT, and lse [N, Hq] fp32 (the natural log of the softmax
denominator) with `return_lse`.

Kernel: a program per (tile, KV head, split). Its M dimension is (row of the tile, query
head of the KV head), tile_rows x GQA padded to a power of two >= 16 for `tl.dot`; it runs
a flash-style online softmax over key blocks of `block_n` keys up to the tile's last
position.

Two passes. The sealed pass (`packed_sealed`, its own lean kernel) reads each split's
leading 64-key groups that every plane up to the depth holds densely and every lane of the
tile reads reconstructed, straight from the INT4 codes with the scales folded into q and p,
and stores the key where it stopped; it is the common case of a decode step without
token-sparse prefill. Tiles of one row and one query head (a GQA-1 model's decode rows)
take the one-lane form of that pass on CUDA cores instead (`packed_sealed_row`; the
tensor-core one skips them on the device). The general kernel (`_attention_kernel`) reads the rest of the split
from that key on, and the combine merges the two partials of every split by lse. Without
`sealed` (or for a head dim the sealed pass does not take) the general kernel reads all.

The general kernel, a block of `block_n` keys at a time (sparse planes, unsealed groups,
the BF16 tail, a tile straddling a seal), takes the
general path: the row maps and group tables of planes 0..d are gathered once
(`_block_rows`: four planes unrolled, those past P or the depth masked off without a load)
and serve both the seals and the decode; they give every key's seal (`_key_seals`); per
(query i, key j) the pair is seen
when j <= q_i and sealed when also q_i >= s_j. Keys some pair reads sealed are decoded
plane by plane (`_reconstructed`: codes, scale and lo loaded only for them; a plane whose
keys in the block all lie in one record loads that record's K scale and minimum once, [D],
instead of per key, and V's per-row parameters load once per 64-channel group, [BLOCK_N],
not per channel) and keys some
pair reads exact load their tail slots (`_exact`); a block with neither kind skips that
half. When every key is read one way by all the pairs that see it (every block of a one-row
tile; blocks wholly below or above the tile's seals), the block merges the two into one K
and one V and runs one QK and one PV product. A block holding a key that some rows read
reconstructed and others exact (the tile straddles its seal) runs both: scores
where(sealed, Q.K_hat, Q.K_exact) and PV as P_hat.V_hat + P_exact.V_exact, with P_hat and
P_exact the probabilities where(sealed, p, 0) and where(sealed, 0, p); K_hat / V_hat are 0
for keys no pair reads sealed and the exact ones 0 for keys no pair reads exact, so a
product never meets storage no pair of the tile reads. `read_keys` exposes a one-row
tile's gather (`_key_block`), so tests check the kernel's reconstruction bit for bit.
Split-KV (`num_splits`) gives each split an equal share of the tile's keys and combines
each row's partial outputs by their lse, as `paged_attention` does; with `min_split_keys`
no split takes fewer keys than that (the last splits of a short context then read
nothing), so a CUDA graph captured with the splits of the longest context a bucket may
see reads a shorter one in fewer, longer splits (the engine: `MIN_SPLIT_KEYS`). With
`exact_gap` g > 0 the caller promises that every record's seal lies at least g past its
last row's position (the engine's tail), so a key within g of a row's position reads exact
for it: a key block of the general kernel lying within g of every row of its tile loads its
tail slots without the row maps, group tables and seals (a decode row's last groups, whose
dependent gathers made the general kernel 22 us a call at batch 1 after 8K on the H100). With `scores` /
`score_rows` (STORE_SCORES) a row with a scores row also stores its scaled scores of keys
0..pos there, as `paged_attention` does, for sparse decode's loop-2 select.

Precision: the general path's gathered K/V tiles hold DT values, the reference's
reconstruction bit for bit (fp32 registers in the decode, DT for the products); QK and PV
run on tensor cores in DT with fp32 accumulation, the probabilities rounded to DT for PV
(fp32 inputs use IEEE fp32 products). The sealed pass is within the reference's
tolerance, not its bits (`packed_sealed`). FMA contraction is off for the general
kernel's launch (the decode must not fuse; what that costs the softmax is not measured).
Under `TRITON_INTERPRET=1` tiles are cast to fp32 before `tl.dot` (the interpreter's bf16
dot is wrong) and rounding to bf16 is done by hand on the bits (its fp32 -> bf16 cast
truncates); see ../shared/docs/gpu.md and `int4_groups`.

Not done yet: the M padding to 16 wastes most of a one-row (decode) program's tensor-core
tile in the general kernel and, with GQA > 1, the sealed pass; a straddling block pays two QK and two PV products; register pressure at M = 64 with
four gathered tiles live in a straddling block is unmeasured. Speed: docs/flashloop.md
("The reader tuned"). Not checked on the
device (no host sync in `packed_attention_triton`): depth < P, positions < MAXLEN, that a
key read reconstructed has a plane-0 row and every row it reads a record, and that tiles
hold at most tile_rows rows of one cell, depth and table offset, each row in at most one
tile (the reference asserts these). The lse of a padding row is not written (the reference
gives -inf).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels import packed_sealed, packed_sealed_row
from specloop.kernels.packed_keys import (
    REFERENCE_DTYPES, _INDEX_POINTERS, PackedKV, _block_rows, _check, _common, _exact, _key_seals, _reconstructed,
    _storage, _use_triton, row_keys,
)
from specloop.kernels.packed_steps import _dot, _lanes, _online, _score_rows
from specloop.kernels.paged_attention import TILE_COLUMNS, check_scores, choose_splits
from specloop.kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# --- Triton ---------------------------------------------------------------------------

# (score_rows_ptr is the positions array itself in a launch that keeps no scores)
@triton.jit(do_not_specialize=["splits", "min_split", "exact_gap"],
            do_not_specialize_on_alignment=_INDEX_POINTERS + ["scores_ptr", "score_rows_ptr"])
def _attention_kernel(
    q_ptr, k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr,
    v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr, cell_ptr, depth_ptr, position_ptr, table_offset_ptr,
    tiles_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stop_ptr, scores_ptr, score_rows_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_on, stride_oh, stride_ln,
    stride_sr, stride_sh, score_keys, num_heads, num_kv_heads, max_groups, max_len, scale, splits, min_split,
    exact_gap, PAGE_SIZE: tl.constexpr, GQA: tl.constexpr, BLOCK_G: tl.constexpr, TILE_ROWS: tl.constexpr,
    HAS_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, ALIGN: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr, WRITE_LSE: tl.constexpr,
    STORE_SCORES: tl.constexpr, AFTER_SEALED: tl.constexpr,
):
    # M: (row of the tile, query head of the KV head); lanes past the tile's rows are padding
    first, rows, table, r, g, row, pos, lane_ok, context = _lanes(
        tiles_ptr, table_offset_ptr, position_ptr, HAS_TILES, GQA, BLOCK_G, BLOCK_M, TILE_ROWS)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if context > 0:
        score_row, score_ok = _score_rows(scores_ptr, score_rows_ptr, row, r, rows, kv_head * GQA + g, lane_ok,
                                          stride_sr, stride_sh, TILE_ROWS, STORE_SCORES)
        cell = tl.load(cell_ptr + first).to(tl.int64)  # the tile's rows share cell and depth
        depth = tl.load(depth_ptr + first).to(tl.int32)
        dtype = k_tail_ptr.dtype.element_ty
        head = kv_head * GQA + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=lane_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(context, splits), ALIGN) * ALIGN, min_split)
        lo = split * chunk
        hi = tl.minimum(context, lo + chunk)
        slot = split
        slots = splits
        if AFTER_SEALED:  # the sealed pass read lo..stop: start there, partials after its own
            lo = tl.load(stop_ptr + (tl.program_id(0).to(tl.int64) * num_kv_heads + kv_head) * splits + split)
            slot = splits + split
            slots = 2 * splits
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            seen = j_ok[None, :] & (j[None, :] <= pos[:, None])
            if start + exact_gap >= context:  # every key within exact_gap of every row: exact, no gather
                r0 = tl.zeros_like(j) - 1
                c0, r1, c1, r2, c2, r3, c3 = r0, r0, r0, r0, r0, r0, r0
                seal = tl.zeros_like(j) + 2147483647
            else:
                r0, c0, r1, c1, r2, c2, r3, c3 = _block_rows(j, j_ok, cell, depth, group_tables_ptr, row_maps_ptr,
                                                             max_groups, max_len, PLANES)
                seal = _key_seals(j, seal_ptr, r0, c0, r1, c1, r2, c2, r3, c3)
            # per (query, key): seen by causality, then read reconstructed (sealed) or exact
            sealed = seen & (pos[:, None] >= seal[None, :])
            recon = tl.max(sealed.to(tl.int32), axis=0) > 0  # keys some query reads reconstructed
            exact = tl.max((seen & ~sealed).to(tl.int32), axis=0) > 0  # keys some query reads exact
            k_hat = tl.zeros([BLOCK_N, BLOCK_D], DOT_DTYPE)
            v_hat = tl.zeros([BLOCK_N, BLOCK_D], DOT_DTYPE)
            if tl.max(recon.to(tl.int32), axis=0) > 0:  # no decode in a block of exact keys
                kr, vr = _reconstructed(recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                                        v_scale_ptr, v_lo_ptr, num_kv_heads, r0, c0, r1, c1, r2, c2, r3, c3,
                                        dtype, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND)
                k_hat = kr.to(DOT_DTYPE)
                v_hat = vr.to(DOT_DTYPE)
            k_ex = tl.zeros([BLOCK_N, BLOCK_D], DOT_DTYPE)
            v_ex = tl.zeros([BLOCK_N, BLOCK_D], DOT_DTYPE)
            if tl.max(exact.to(tl.int32), axis=0) > 0:  # no tail load in a block of sealed keys
                ke, ve = _exact(j, exact, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr, stride_ks,
                                stride_kh, stride_vs, stride_vh, PAGE_SIZE, HEAD_DIM, BLOCK_D)
                k_ex = ke.to(DOT_DTYPE)
                v_ex = ve.to(DOT_DTYPE)
            # a key that some queries read reconstructed and others exact (the tile straddles
            # its seal) needs both versions in the block's products; otherwise one K and one V
            both = tl.max((recon & exact).to(tl.int32), axis=0) > 0
            if both:
                s = tl.where(sealed, _dot(q, tl.trans(k_hat), DOT_FP32), _dot(q, tl.trans(k_ex), DOT_FP32))
            else:
                s = _dot(q, tl.trans(tl.where(recon[:, None], k_hat, k_ex)), DOT_FP32)
            p, alpha, m_i, l_i = _online(s, seen, j, m_i, l_i, scale, score_row, score_ok, score_keys,
                                         STORE_SCORES)
            if both:
                pv = _dot(tl.where(sealed, p, 0.0).to(DOT_DTYPE), v_hat, DOT_FP32)
                pv += _dot(tl.where(sealed, 0.0, p).to(DOT_DTYPE), v_ex, DOT_FP32)
            else:
                pv = _dot(p.to(DOT_DTYPE), tl.where(recon[:, None], v_hat, v_ex), DOT_FP32)
            acc = acc * alpha[:, None] + pv
        empty = l_i == 0.0  # a split past the row's position
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
        if not SPLIT:
            o = round_to(o, out_ptr.dtype.element_ty, BF16_BY_HAND)
            tl.store(out_ptr + row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=lane_ok[:, None] & d_ok[None, :])
            if WRITE_LSE:
                tl.store(lse_ptr + row * stride_ln + head, lse, mask=lane_ok)
        else:
            at = (row * num_heads + head) * slots + slot
            tl.store(part_o_ptr + at[:, None] * BLOCK_D + d[None, :], o, mask=lane_ok[:, None])
            tl.store(part_lse_ptr + at, lse, mask=lane_ok)


@triton.jit(do_not_specialize=["splits"], do_not_specialize_on_alignment=_INDEX_POINTERS)
def _combine_kernel(
    part_o_ptr, part_lse_ptr, position_ptr, tiles_ptr, out_ptr, lse_ptr, stride_on, stride_oh, stride_ln,
    num_heads, splits, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr, HAS_TILES: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Per (row r of a tile, query head): the splits' outputs weighted by exp(lse_s - lse)."""
    at_tile = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    r = at_tile % TILE_ROWS
    if HAS_TILES:
        first = tl.load(tiles_ptr + at_tile // TILE_ROWS * 3).to(tl.int64)
        rows = tl.load(tiles_ptr + at_tile // TILE_ROWS * 3 + 1)
    else:  # TILE_ROWS is 1: program t combines row t
        first = at_tile
        rows = 1
    n = first + r
    if r < rows:
        if tl.load(position_ptr + n) >= 0:
            s = tl.arange(0, BLOCK_S)
            d = tl.arange(0, BLOCK_D)
            s_ok = s < splits
            at = (n * num_heads + head) * splits + s
            lse_s = tl.load(part_lse_ptr + at, mask=s_ok, other=float("-inf"))
            top = tl.max(lse_s, axis=0)  # finite: split 0 always holds key 0
            w = tl.exp(lse_s - top)
            total = tl.sum(w, axis=0)
            o = tl.load(part_o_ptr + at[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
            o = round_to(tl.sum(w[:, None] * o, axis=0) / total, out_ptr.dtype.element_ty, BF16_BY_HAND)
            tl.store(out_ptr + n * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
                     mask=d < HEAD_DIM)
            if WRITE_LSE:
                tl.store(lse_ptr + n * stride_ln + head, top + tl.log(total))


def _check_tiles(tiles: torch.Tensor | None, tile_rows: int | None) -> int:
    """The tile rows a launch takes: `tile_rows` (>= 1) with tiles; 1 without (a tile per row,
    whatever tile_rows says)."""
    if tiles is None:
        return 1
    assert tile_rows is not None and tile_rows >= 1, "tiles need tile_rows >= 1"
    assert tiles.dim() == 2 and tiles.shape[1] == TILE_COLUMNS and tiles.is_contiguous(), "tiles must be [M, 3]"
    assert not tiles.is_floating_point(), "tiles are integers"
    return tile_rows


MIN_SPLIT_KEYS = 512  # the engine's min_split_keys: the most splits packed_splits gives a context


def packed_splits(num_tiles: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-KV for the packed reader: `choose_splits`, then more splits (up to 64, none
    under 512 keys) while the grid stays within 8 waves of the GPU. Its per-key cost is
    latency (dependent gathers), so a few programs on a long context need more splits than
    the BF16 kernel: on the H200 at batch 1, 64 splits read 32K keys 1.25x faster than
    `choose_splits`' 17, which stay best at 8K (bench/results/packed_reader_sweep_h200.json;
    only batch 1 was swept)."""
    base = choose_splits(num_tiles, num_kv_heads, max_context, num_sms)
    # (with min_split_keys = MIN_SPLIT_KEYS the kernels use fewer of them on a shorter context)
    waves = max(1, 8 * num_sms // max(1, num_tiles * num_kv_heads))
    return max(base, min(64, waves, max_context // 512))


def packed_attention_triton(q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor,
                            page_size: int, packed: PackedKV, cell: torch.Tensor, depth: torch.Tensor,
                            position: torch.Tensor, table_offset: torch.Tensor, *, tiles: torch.Tensor | None = None,
                            tile_rows: int | None = None, return_lse: bool = False, num_splits: int = 1,
                            block_n: int = 32, out: torch.Tensor | None = None, num_warps: int | None = None,
                            scores: torch.Tensor | None = None, score_rows: torch.Tensor | None = None,
                            sealed: bool = True, sealed_warps: int | None = None, sealed_chunk: int = 32,
                            sealed_row: bool = True, max_registers: int | None = None,
                            min_split_keys: int = 0, exact_gap: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch (tiles, KV heads, splits) programs (a tile per row without `tiles`): with
    `sealed` (and a head dim `packed_sealed.supported` takes) the sealed pass first, then the
    general kernel from each split's stop key; the combine when split or sealed. No host sync
    (tiles are not checked against the rows: the reference checks them). `num_warps` and
    `max_registers` (ptxas' maxnreg) shape the general kernel, `sealed_warps` and
    `sealed_chunk` (the channels a score product takes at once) the sealed pass. With
    `sealed_row` (GQA 1, a head dim `packed_sealed_row.supported` takes) one-row tiles'
    sealed groups go to the one-lane pass on CUDA cores, longer tiles' to the tensor-core
    one (each kernel skips the other's tiles on the device)."""
    rows = (cell, depth, position, table_offset)
    if q.shape[0] and (tiles is None or tiles.shape[0]):  # (a pass of prompt chunks alone reads nothing here)
        _check(q, k_tail, v_tail, tables, packed, rows)
    tile_rows = _check_tiles(tiles, tile_rows)
    assert min_split_keys % max(block_n, packed_sealed.GROUP) == 0, "min_split_keys: a multiple of the key blocks"
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_tail.shape[1]
    gqa = num_heads // num_kv_heads
    # 16 compiles under the interpreter but crashes Triton's layout pass on the H200 (an MLIR
    # failure in TritonGPURemoveLayoutConversions, fp16 MHA head dim 16, seen at 7464ba2)
    assert block_n >= 32 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 32"
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    num_tiles = n if tiles is None else tiles.shape[0]
    if n == 0 or num_tiles == 0:
        return out, lse
    common = _common(k_tail, packed, page_size)
    lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
    tiles_arg = tiles if tiles is not None else position  # never read without HAS_TILES
    sealed = sealed and packed_sealed.supported(head_dim)
    slots = num_splits * (2 if sealed else 1)  # partial outputs a row: the sealed pass's, the general kernel's
    part_o = part_lse = stop = out
    if slots > 1:
        part_o = torch.empty(n * num_heads * slots, common["BLOCK_D"], dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n * num_heads * slots, dtype=torch.float32, device=q.device)
    lse_stride = lse.stride(0) if lse is not None else 0
    dot_fp32 = _INTERPRET or q.dtype == torch.float32
    dot_dtype = tl.float32 if dot_fp32 else _TL_DTYPES[q.dtype]
    bg = triton.next_power_of_2(gqa)
    block_m = max(16, triton.next_power_of_2(tile_rows * bg))
    store_scores = check_scores(scores, score_rows, n, num_heads)
    scores_arg = scores if store_scores else out
    score_rows_arg = score_rows if store_scores else position
    one_lane = sealed and sealed_row and gqa == 1 and packed_sealed_row.supported(head_dim)
    if sealed:
        stop = torch.empty(num_tiles * num_kv_heads * num_splits, dtype=torch.int32, device=q.device)
    if one_lane:
        packed_sealed_row.row_pass(
            q, _storage(k_tail, v_tail, tables, packed)[3:], rows, tiles_arg, part_o, part_lse, stop, num_tiles,
            num_splits, min_split_keys, has_tiles=tiles is not None, num_kv_heads=num_kv_heads,
            max_groups=packed.group_tables.shape[2], max_len=packed.row_maps.shape[2], planes=packed.planes,
            block_d=common["BLOCK_D"], exact=q.dtype == torch.float32, store_scores=store_scores,
            scores=scores_arg, score_rows=score_rows_arg, num_warps=sealed_warps)
    if sealed and not (one_lane and (tiles is None or tile_rows == 1)):
        packed_sealed.sealed_pass(
            q, _storage(k_tail, v_tail, tables, packed)[3:], rows, tiles_arg, part_o, part_lse, stop, num_tiles,
            num_splits, min_split_keys, tile_rows=tile_rows, has_tiles=tiles is not None, num_kv_heads=num_kv_heads,
            max_groups=packed.group_tables.shape[2], max_len=packed.row_maps.shape[2], planes=packed.planes,
            block_m=block_m, block_g=bg, block_d=common["BLOCK_D"], dot_fp32=dot_fp32, dot_dtype=dot_dtype,
            store_scores=store_scores, scores=scores_arg, score_rows=score_rows_arg, num_warps=sealed_warps,
            chunk=sealed_chunk, skip_one_row=one_lane)
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, *_storage(k_tail, v_tail, tables, packed), *rows, tiles_arg, out, lse_arg, part_o, part_lse, stop,
        scores if store_scores else out, score_rows if store_scores else position,
        q.stride(0), q.stride(1), k_tail.stride(0), k_tail.stride(1), v_tail.stride(0), v_tail.stride(1),
        out.stride(0), out.stride(1), lse_stride, scores.stride(0) if store_scores else 0,
        scores.stride(1) if store_scores else 0, scores.shape[2] if store_scores else 0,
        num_heads, num_kv_heads, packed.group_tables.shape[2], packed.row_maps.shape[2], head_dim ** -0.5, num_splits,
        min_split_keys, exact_gap,
        GQA=gqa, BLOCK_G=bg, TILE_ROWS=tile_rows, HAS_TILES=tiles is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=slots > 1, ALIGN=max(block_n, packed_sealed.GROUP),
        DOT_FP32=dot_fp32, DOT_DTYPE=dot_dtype, WRITE_LSE=return_lse, STORE_SCORES=store_scores,
        AFTER_SEALED=sealed, enable_fp_fusion=False,
        **({} if num_warps is None else {"num_warps": num_warps}),
        **({} if max_registers is None else {"maxnreg": max_registers}),
        **common,
    )
    if slots > 1:
        _combine_kernel[(num_tiles * tile_rows, num_heads)](
            part_o, part_lse, position, tiles_arg, out, lse_arg, out.stride(0), out.stride(1), lse_stride,
            num_heads, slots, HEAD_DIM=head_dim, TILE_ROWS=tile_rows, HAS_TILES=tiles is not None,
            BLOCK_S=triton.next_power_of_2(slots), BLOCK_D=common["BLOCK_D"],
            BF16_BY_HAND=common["BF16_BY_HAND"], WRITE_LSE=return_lse,
        )
    return out, lse


# --- torch reference ------------------------------------------------------------------

def tile_rows_covered(tiles: torch.Tensor, tile_rows: int, cell: torch.Tensor, depth: torch.Tensor,
                      table_offset: torch.Tensor) -> torch.Tensor:
    """Which rows [N] (bool) `tiles` cover, asserting the kernel's contract (host side, it
    syncs): at most tile_rows rows a tile, each row at most once, a tile's rows sharing its
    first row's cell and depth and the tile's table offset."""
    _check_tiles(tiles, tile_rows)
    n = cell.shape[0]
    covered = torch.zeros(n, dtype=torch.bool)
    cells, depths, offsets = cell.tolist(), depth.tolist(), table_offset.tolist()
    for first, rows, table in tiles.tolist():
        if rows == 0:  # padding
            continue
        assert 0 < rows <= tile_rows and 0 <= first and first + rows <= n, f"tile {(first, rows, table)} out of range"
        span = range(first, first + rows)
        assert not covered[first:first + rows].any(), f"tile {(first, rows, table)} covers a row twice"
        covered[first:first + rows] = True
        assert {(cells[i], depths[i], offsets[i]) for i in span} == {(cells[first], depths[first], table)}, (
            f"tile {(first, rows, table)}: rows of one cell, depth and table offset")
    return covered.to(cell.device)


def packed_attention_reference(q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor,
                               page_size: int, packed: PackedKV, cell: torch.Tensor, depth: torch.Tensor,
                               position: torch.Tensor, table_offset: torch.Tensor, *,
                               tiles: torch.Tensor | None = None, tile_rows: int | None = None,
                               return_lse: bool = False, num_splits: int = 1, block_n: int = 32,
                               out: torch.Tensor | None = None, scores: torch.Tensor | None = None,
                               score_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same, row by row in plain PyTorch: `row_keys`, then fp32 scores, softmax and
    weighted sum (fp64 for fp64 inputs, which only the reference takes; num_splits and
    block_n only shape the kernel's work and are ignored here). With `tiles`, only the rows
    they cover (the tiles checked by `tile_rows_covered`); tiles shape nothing else.
    Padding rows (negative position) and rows no tile covers are left as `out` had them
    (zeros when new; lse -inf); so are their scores rows."""
    _check(q, k_tail, v_tail, tables, packed, (cell, depth, position, table_offset), REFERENCE_DTYPES)
    n, num_heads, head_dim = q.shape
    score_at = score_rows.tolist() if check_scores(scores, score_rows, n, num_heads) else [-1] * n
    covered = [True] * n if tiles is None else tile_rows_covered(tiles, tile_rows, cell, depth, table_offset).tolist()
    gqa = num_heads // k_tail.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros_like(q) if out is None else out
    lse = torch.full((n, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for i, (c, d, pos, off) in enumerate(zip(cell.tolist(), depth.tolist(), position.tolist(), table_offset.tolist())):
        if pos < 0 or not covered[i]:
            continue
        k, v = row_keys(k_tail, v_tail, tables, page_size, packed, c, d, pos, off)
        k = k.to(compute).repeat_interleave(gqa, dim=1)  # [L, Hq, D]
        v = v.to(compute).repeat_interleave(gqa, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].to(compute), k) * head_dim ** -0.5
        lse[i] = torch.logsumexp(s, dim=-1).float()
        out[i] = torch.einsum("hl,lhd->hd", s.softmax(-1), v).to(q.dtype)
        if score_at[i] >= 0:
            keys = min(pos + 1, scores.shape[2])
            scores[score_at[i], :, :keys] = s[:, :keys].float()
    return out, (lse if return_lse else None)


# --- dispatch -------------------------------------------------------------------------

def packed_attention(q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor,
                     page_size: int, packed: PackedKV, cell: torch.Tensor, depth: torch.Tensor,
                     position: torch.Tensor, table_offset: torch.Tensor, *, tiles: torch.Tensor | None = None,
                     tile_rows: int | None = None, return_lse: bool = False, num_splits: int = 1,
                     block_n: int = 32, out: torch.Tensor | None = None, scores: torch.Tensor | None = None,
                     score_rows: torch.Tensor | None = None, min_split_keys: int = 0, exact_gap: int = 0,
                     use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out [N, Hq, D] (q's dtype) and, with return_lse, lse [N, Hq] fp32: each row's
    attention over keys 0..position as the read rule gives them (module docstring); with
    `tiles` [M, 3] (first row, rows, table offset) only the rows they cover, each tile's
    rows sharing its key blocks (at most `tile_rows` rows of one cell, depth and table).
    With `scores` (fp32 [R, Hq, keys]) and `score_rows` ([N] int, -1 for none), row i's
    scaled scores q . k / sqrt(D) of keys 0..pos (below `keys`) also go to
    scores[score_rows[i]], as `paged_attention` keeps them (sparse decode's loop-2 select
    reads them: no second read of the packed keys)."""
    if not _use_triton(q, use_triton):
        return packed_attention_reference(q, k_tail, v_tail, tables, page_size, packed, cell, depth, position,
                                          table_offset, tiles=tiles, tile_rows=tile_rows, return_lse=return_lse,
                                          out=out, scores=scores, score_rows=score_rows)
    return packed_attention_triton(q, k_tail, v_tail, tables, page_size, packed, cell, depth, position, table_offset,
                                   tiles=tiles, tile_rows=tile_rows, return_lse=return_lse, num_splits=num_splits,
                                   block_n=block_n, out=out, scores=scores, score_rows=score_rows,
                                   min_split_keys=min_split_keys, exact_gap=exact_gap)
