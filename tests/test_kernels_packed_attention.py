"""Packed attention (K/V exact from tail pages or reconstructed from INT4 residual groups):
the torch reference against a brute force and the FlashLoop reference, the kernel against
the torch reference.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU); shapes stay small for the interpreter. A case is
a few request cells of 4 planes with nested rows (absent rows at planes 1..3), plane maps
that do not start at compact row 0, records in shuffled order, a group without a record,
seals below, at and above the query positions and NEVER, and query rows of every depth in
one call: rows that read only exact keys, only reconstructed ones, and both. Tolerances:
K/V as read bit for bit; outputs fp32 1e-5, fp16 5e-3, bf16 2e-2; lse fp32 1e-5, bf16 and
fp16 1e-3.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

from specloop.kernels.int4_groups import quantize_k_groups, quantize_v_groups, split_k_plane
from specloop.kernels.packed_attention import (
    packed_attention,
    packed_attention_reference,
    packed_attention_triton,
    packed_splits,
)
from specloop.kernels.packed_keys import (
    PackedKV,
    key_seals,
    read_keys,
    read_keys_reference,
    read_keys_triton,
    reconstruct_keys,
    row_keys,
)
from specloop.kernels.packed_rows import NEVER
from specloop.kernels.paged_attention import choose_splits
from specloop.model.flashloop_reference import quantize_rows, read_kv, residual_encode, seal_positions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLANES = 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LSE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


@dataclasses.dataclass
class Case:
    q: torch.Tensor
    k_tail: torch.Tensor
    v_tail: torch.Tensor
    tables: torch.Tensor
    page_size: int
    packed: PackedKV
    cell: torch.Tensor
    depth: torch.Tensor
    position: torch.Tensor
    table_offset: torch.Tensor

    def args(self) -> tuple:
        return (self.q, self.k_tail, self.v_tail, self.tables, self.page_size, self.packed, self.cell,
                self.depth, self.position, self.table_offset)

    def storage(self) -> tuple:
        return self.args()[1:]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = _bits(got) != _bits(want)
    assert not differ.any(), f"{int(differ.sum())} of {got.numel()} differ: {got[differ][:4]} vs {want[differ][:4]}"


def _case(seed: int, lengths: list[int], modes: list[str], rows: list[tuple[int, int, int]], heads: int,
          kv_heads: int, dim: int, dtype: torch.dtype, page_size: int = 16, keep: float = 0.7,
          shift: bool = True) -> Case:
    """Cells of the given lengths (a share `keep` of a plane's rows also at the next; compact
    rows from a random start, or from 0 without `shift`); `modes` per cell: "open" (every record NEVER), "sealed"
    (every record sealed at 0) or "mixed" (NEVER, 0, a random position, a query position of
    the cell or one past it); rows (cell, depth, position)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    max_len = max(lengths)
    cells = len(lengths)
    row_maps = torch.full((cells, PLANES, max_len), -1, dtype=torch.int32)
    owners: list[tuple[int, int]] = []  # (cell, plane) of each compact group
    groups_of: dict[tuple[int, int], int] = {}
    for c, t in enumerate(lengths):
        has = torch.ones(t, dtype=torch.bool)
        for p in range(PLANES):
            if p:
                has = has & (torch.rand(t, generator=gen) < keep)
            start = int(torch.randint(0, 6, (1,), generator=gen))  # compact rows need not start at 0
            start = start if shift else 0
            count = int(has.sum())
            row_maps[c, p, :t][has] = torch.arange(count, dtype=torch.int32) + start
            groups_of[c, p] = -(-(count + start) // 64)
            owners.extend([(c, p)] * groups_of[c, p])
    spare = 3  # records no table points at
    order = torch.randperm(len(owners) + spare, generator=gen).tolist()
    max_groups = max(groups_of.values())
    group_tables = torch.full((cells, PLANES, max_groups), -1, dtype=torch.int32)
    seal = torch.full((len(owners) + spare,), NEVER, dtype=torch.int32)
    plane_of = torch.zeros(len(owners) + spare, dtype=torch.long)
    i = 0
    for c in range(cells):
        positions = [pos for cc, _, pos in rows if cc == c] or [0]
        for p in range(PLANES):
            for g in range(groups_of[c, p]):
                rec = order[i]
                i += 1
                group_tables[c, p, g] = rec
                plane_of[rec] = p
                if modes[c] == "sealed":
                    seal[rec] = 0
                elif modes[c] == "mixed":
                    at = positions[int(torch.randint(0, len(positions), (1,), generator=gen))]
                    seal[rec] = [NEVER, 0, int(torch.randint(0, lengths[c], (1,), generator=gen)), at, at + 1][i % 5]
        last = groups_of[c, PLANES - 1] - 1  # a deepest-plane group without a record: read exact
        if c == 0 and last >= 0:
            group_tables[c, PLANES - 1, last] = -1
    ng = len(owners) + spare
    residual = torch.where(plane_of == 0, 1.0, 0.1)  # residuals are small
    k_rec = rand(ng, 64, kv_heads, dim) * residual[:, None, None, None].to(dtype)
    v_rec = rand(ng * 64, kv_heads, dim) * residual.repeat_interleave(64)[:, None, None].to(dtype)
    packed = PackedKV(quantize_k_groups(k_rec, torch.full((ng,), 64)), quantize_v_groups(v_rec), seal,
                      group_tables, row_maps)
    # tails: a shuffled page table per (cell, plane)
    need = [-(-t // page_size) for t in lengths]
    pages = sum(need) * PLANES + 4
    perm = torch.randperm(pages, generator=gen).tolist()
    tables, offsets = [], {}
    for c in range(cells):
        for p in range(PLANES):
            offsets[c, p] = len(tables)
            tables.extend(perm[len(tables): len(tables) + need[c]])
    k_tail, v_tail = rand(pages * page_size, kv_heads, dim), rand(pages * page_size, kv_heads, dim)
    q = rand(len(rows), heads, dim)
    to = dict(device=DEVICE)
    col = lambda values: torch.tensor(values, dtype=torch.int32, **to)  # noqa: E731
    packed = PackedKV(*[type(x)(x.codes.to(DEVICE), x.scale.to(DEVICE), x.lo.to(DEVICE)) for x in (packed.k, packed.v)],
                      seal.to(DEVICE), group_tables.to(DEVICE), row_maps.to(DEVICE))
    return Case(q.to(**to), k_tail.to(**to), v_tail.to(**to), col(tables), page_size, packed,
                col([c for c, _, _ in rows]), col([d for _, d, _ in rows]), col([pos for _, _, pos in rows]),
                col([offsets[c, d] for c, d, _ in rows]))


def _seal_kinds(case: Case) -> set[str]:
    """Which of below / at / above the query position and NEVER the rows' keys have as seals."""
    kinds = set()
    for c, d, pos in zip(case.cell.tolist(), case.depth.tolist(), case.position.tolist()):
        seal = key_seals(case.packed, c, d, torch.arange(pos + 1, device=DEVICE))
        kinds |= {name for name, hit in (("below", seal < pos), ("at", seal == pos),
                                         ("above", (seal > pos) & (seal < NEVER)), ("never", seal == NEVER)) if hit.any()}
    return kinds


def _reads(case: Case) -> list[str]:
    """Per row: "exact", "reconstructed" or "mixed" (what its keys read)."""
    kinds = []
    for c, d, pos in zip(case.cell.tolist(), case.depth.tolist(), case.position.tolist()):
        sealed = pos >= key_seals(case.packed, c, d, torch.arange(pos + 1, device=DEVICE))
        kinds.append("reconstructed" if sealed.all() else "mixed" if sealed.any() else "exact")
    return kinds


# --- the reference against a brute force -----------------------------------------------

def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _rounder(dtype: torch.dtype):
    """x (a Python float holding an fp32 value) -> the nearest dtype value."""
    if dtype == torch.float32:
        return lambda x: x
    return lambda x: torch.tensor(x, dtype=torch.float32).to(dtype).item()


def _brute_key(s: dict, c: int, d: int, pos: int, off: int, j: int, dtype: torch.dtype) -> tuple[list, list]:
    """K and V [Hkv][D] of key j for one query row, element by element from the rule."""
    rnd = _rounder(dtype)
    seal = NEVER
    for p in range(d + 1):
        r = s["row_maps"][c][p][j]
        if r >= 0:
            g = s["group_tables"][c][p][r // 64]
            seal = s["seal"][g] if g >= 0 else NEVER
    heads, dim = len(s["k_tail"][0]), len(s["k_tail"][0][0])
    if pos < seal:
        slot = s["tables"][off + j // s["page_size"]] * s["page_size"] + j % s["page_size"]
        return s["k_tail"][slot], s["v_tail"][slot]
    k = [[0.0] * dim for _ in range(heads)]
    v = [[0.0] * dim for _ in range(heads)]
    for h in range(heads):
        for ch in range(dim):
            xk = xv = None
            for p in range(d + 1):
                r = s["row_maps"][c][p][j]
                if r < 0:
                    assert p > 0
                    continue
                g, i = s["group_tables"][c][p][r // 64], r % 64
                byte = s["k_codes"][g][i // 2][h][ch]
                code = byte & 15 if i % 2 == 0 else byte >> 4
                dk = rnd(_f32(s["k_lo"][g][h][ch] + s["k_scale"][g][h][ch] * code))
                byte = s["v_codes"][g * 64 + i][h][ch // 2]
                code = byte & 15 if ch % 2 == 0 else byte >> 4
                dv = rnd(_f32(s["v_lo"][g * 64 + i][h][ch // 64] + s["v_scale"][g * 64 + i][h][ch // 64] * code))
                xk = dk if xk is None else rnd(_f32(xk + dk))
                xv = dv if xv is None else rnd(_f32(xv + dv))
            k[h][ch], v[h][ch] = xk, xv
    return k, v


def _as_lists(case: Case) -> dict:
    pk = case.packed
    return dict(row_maps=pk.row_maps.tolist(), group_tables=pk.group_tables.tolist(), seal=pk.seal.tolist(),
                k_codes=pk.k.codes.tolist(), k_scale=pk.k.scale.float().tolist(), k_lo=pk.k.lo.float().tolist(),
                v_codes=pk.v.codes.tolist(), v_scale=pk.v.scale.float().tolist(), v_lo=pk.v.lo.float().tolist(),
                k_tail=case.k_tail.float().tolist(), v_tail=case.v_tail.float().tolist(),
                tables=case.tables.tolist(), page_size=case.page_size)


def _tiny_rows() -> list[tuple[int, int, int]]:
    rows = []
    for d in range(PLANES):
        rows += [(0, d, 69), (0, d, 30), (1, d, 39), (2, d, 25)]
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_rule_key_by_key(dtype):
    """row_keys bit for bit against the rule applied element by element, and the attention
    against softmax written out in Python floats."""
    case = _case(1, [70, 40, 26], ["mixed", "sealed", "open"], _tiny_rows(), 4, 2, 16, dtype)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    assert _seal_kinds(case) == {"below", "at", "above", "never"}
    s = _as_lists(case)
    out, lse = packed_attention_reference(*case.args(), return_lse=True)
    gqa = 2
    for n, (c, d, pos, off) in enumerate(zip(case.cell.tolist(), case.depth.tolist(), case.position.tolist(),
                                             case.table_offset.tolist())):
        keys = [_brute_key(s, c, d, pos, off, j, dtype) for j in range(pos + 1)]
        k, v = row_keys(*case.storage()[:-4], c, d, pos, off)
        _same(k, torch.tensor([kj for kj, _ in keys], dtype=dtype, device=DEVICE))
        _same(v, torch.tensor([vj for _, vj in keys], dtype=dtype, device=DEVICE))
        for head in range(4):
            qh = case.q[n, head].float().tolist()
            scores = [sum(a * b for a, b in zip(qh, kj[head // gqa])) / math.sqrt(16) for kj, _ in keys]
            top = max(scores)
            w = [math.exp(x - top) for x in scores]
            total = sum(w)
            want = [sum(wj * vj[head // gqa][ch] for wj, (_, vj) in zip(w, keys)) / total for ch in range(16)]
            torch.testing.assert_close(out[n, head].float(), torch.tensor(want, device=DEVICE).to(dtype).float(),
                                       atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
            assert abs(float(lse[n, head]) - (top + math.log(total))) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_reference_and_kernel_read_what_flashloop_reads(dtype):
    """Records encoded from a stack of planes as the FlashLoop reference encodes them (plane
    0's rows, then each plane's residuals of its compact rows against the reconstruction
    before): depth d reconstructs as its X^(d+1) bit for bit, and row_keys and (bf16) the
    kernel's gather read what its `read_kv` reads under its own seal positions (tail 16)."""
    gen = torch.Generator().manual_seed(5)
    t, heads, dim, tail, page_size = 150, 2, 16, 16, 16
    has = [torch.ones(t, dtype=torch.bool)]
    for _ in range(1, PLANES):
        has.append(has[-1] & (torch.rand(t, generator=gen) < 0.8))
    xs, hats = {}, {}
    for kind in "kv":
        xs[kind] = [torch.randn(t, heads, dim, generator=gen).to(dtype)]
        hats[kind] = [quantize_rows(xs[kind][0], kind, 4, 64)]
        for p in range(1, PLANES):
            step = (0.2 * torch.randn(t, heads, dim, generator=gen)).to(dtype)
            xs[kind].append(torch.where(has[p][:, None, None], xs[kind][-1] + step, xs[kind][-1]))
            hats[kind].append(residual_encode(hats[kind][-1], xs[kind][p], has[p], kind, 4, 64))
    seals = [seal_positions(None, has[0], 64, tail)]
    for p in range(1, PLANES):
        seals.append(seal_positions(seals[-1], has[p], 64, tail))
    row_maps = torch.full((1, PLANES, t), -1, dtype=torch.int32)
    k_groups, k_valid, v_rows, group_tables, record_seal = [], [], [], [], []
    for p in range(PLANES):
        rows = has[p].nonzero().flatten()
        row_maps[0, p, rows] = torch.arange(rows.numel(), dtype=torch.int32)
        delta = {kind: xs[kind][p][rows] - (hats[kind][p - 1][rows] if p else 0) for kind in "kv"}
        groups, valid = split_k_plane(delta["k"])
        k_groups.append(groups)
        k_valid.append(valid)
        v_rows.append(torch.cat([delta["v"], delta["v"].new_zeros(groups.shape[0] * 64 - rows.numel(), heads, dim)]))
        group_tables.append([len(record_seal) + g for g in range(groups.shape[0])])
        record_seal.extend(min(int(seals[p][rows[64 * g]]), NEVER) for g in range(groups.shape[0]))
    width = max(map(len, group_tables))
    packed = PackedKV(quantize_k_groups(torch.cat(k_groups), torch.cat(k_valid)), quantize_v_groups(torch.cat(v_rows)),
                      torch.tensor(record_seal, dtype=torch.int32),
                      torch.tensor([[g + [-1] * (width - len(g)) for g in group_tables]], dtype=torch.int32), row_maps)
    pages = -(-t // page_size)  # plane d's table: pages d * pages ..
    tails = [torch.cat([torch.cat([x, x.new_zeros(pages * page_size - t, heads, dim)]) for x in xs[kind]])
             for kind in "kv"]
    tables = torch.arange(PLANES * pages, dtype=torch.int32)
    j = torch.arange(t)
    rows = [(d, pos) for d in range(PLANES) for pos in (40, 100, 149)]
    wants = []
    for d, pos in rows:
        for got, kind in zip(reconstruct_keys(packed, 0, d, j, dtype), "kv"):
            _same(got, hats[kind][d])
        want = [read_kv(xs[kind][d], hats[kind][d], seals[d], torch.tensor([pos]))[0] for kind in "kv"]
        got = row_keys(*tails, tables, page_size, packed, 0, d, pos, d * pages)
        for g, w in zip(got, want):
            _same(g, w[: pos + 1])
        wants.append([w.masked_fill(j[:, None, None] > pos, 0.0) for w in want])
    assert 0 < sum(int((pos >= seals[d]).sum()) for d, pos in rows) < sum(pos + 1 for _, pos in rows)
    if dtype == torch.float64:  # the kernel takes fp32, bf16 and fp16
        return
    col = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    on = lambda x: type(x)(x.codes.to(DEVICE), x.scale.to(DEVICE), x.lo.to(DEVICE))  # noqa: E731
    packed = PackedKV(on(packed.k), on(packed.v), *(x.to(DEVICE) for x in (packed.seal, packed.group_tables, row_maps)))
    got = read_keys(*(x.to(DEVICE) for x in tails), tables.to(DEVICE), page_size, packed, col([0] * len(rows)),
                    col([d for d, _ in rows]), col([pos for _, pos in rows]), col([d * pages for d, _ in rows]), t,
                    use_triton=True)
    for g, kind in zip(got, (0, 1)):
        _same(g.cpu(), torch.stack([w[kind] for w in wants]))


# --- the kernel against the reference --------------------------------------------------

def _rows() -> list[tuple[int, int, int]]:
    """Rows of every depth: long contexts (> block_n) in the mixed cell 0, short and long ones
    in the sealed cell 1 and the open cell 2."""
    return [(0, 3, 149), (0, 0, 149), (0, 1, 97), (0, 2, 130), (0, 3, 64), (0, 0, 5),
            (1, 2, 99), (1, 0, 17), (1, 3, 0), (2, 1, 79), (2, 3, 40)]


def _shapes_by_dtype(dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> list[tuple]:
    """Every dtype with every shape on the GPU; under the interpreter (CPU, about 12 s a
    case) each shape once with the dtypes taking turns, so each dtype and each shape still
    runs (the GPU suite runs the product)."""
    if torch.cuda.is_available():
        return [(d, *s) for d in dtypes for s in shapes]
    return [(dtypes[i % len(dtypes)], *s) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype, heads, kv_heads, dim", _shapes_by_dtype(
    [torch.float32, torch.bfloat16], [(4, 2, 16), (2, 2, 64), (2, 2, 96), (4, 2, 128)]))
def test_kernel_matches_reference(dtype, heads, kv_heads, dim):
    case = _case(dim + heads, [150, 100, 80], ["mixed", "sealed", "open"], _rows(), heads, kv_heads, dim, dtype)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    assert _seal_kinds(case) == {"below", "at", "above", "never"}
    splits, block_n = (2, 32) if dim == 64 else (1, 64)
    _kernel_reads_like_reference(case, dtype, num_splits=splits, block_n=block_n)


def _kernel_reads_like_reference(case: Case, dtype: torch.dtype, **kw) -> None:
    """Attention within the tolerances of the reference, and every key read bit for bit
    (`read_keys`' outputs start empty, so the zeros past each row's position are checked too)."""
    out, lse = packed_attention_triton(*case.args(), return_lse=True, **kw)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    k, v = read_keys_triton(*case.storage(), 150)
    want_k, want_v = read_keys_reference(*case.storage(), 150)
    _same(k, want_k)
    _same(v, want_v)


@pytest.mark.parametrize("dtype, block_n, splits", [(torch.float32, 64, 1), (torch.bfloat16, 32, 3)])
def test_sealed_pass_reads_dense_sealed_groups(dtype, block_n, splits):
    """Dense planes (every position a row at every plane, compact rows from 0: the engine's
    planes without token-sparse prefill or exits) with seals below, at and above the rows
    and NEVER, decode rows and tiles: the sealed pass (`packed_sealed`) reads the leading
    dense sealed 64-key groups of each split from the codes, the general kernel the rest,
    within the reference's tolerance (its score products 32 or 64 channels at a time), as
    the general kernel alone (sealed=False) is. A
    probe shows the sealed pass is taken: row maps broken inside such groups (not at their
    last key, which it checks) change what the general kernel reads and nothing the sealed
    pass reads."""
    rows = [(0, d, pos) for d in range(PLANES) for pos in (149, 130, 70)] + [(1, 3, 99), (1, 0, 64), (2, 2, 79)]
    case = _case(5, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, 32, dtype, keep=1.0, shift=False)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    kw = dict(return_lse=True, block_n=block_n, num_splits=splits)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    for how in (dict(sealed=True), dict(sealed=True, sealed_chunk=64), dict(sealed=False)):
        out, lse = packed_attention_triton(*case.args(), **how, **kw)
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    # tiles of rows of one cell and depth: groups every row reads one way, and straddling ones
    order = sorted(range(len(rows)), key=lambda i: rows[i][:2])
    tiled = dataclasses.replace(case, **{f: getattr(case, f)[order] for f in
                                        ("q", "cell", "depth", "position", "table_offset")})
    groups: dict = {}
    for n, i in enumerate(order):
        groups.setdefault(rows[i][:2], []).append(n)
    tiles = torch.tensor([[ns[0], len(ns), int(tiled.table_offset[ns[0]])] for ns in groups.values()],
                         dtype=torch.int32, device=DEVICE)
    kw = dict(kw, tiles=tiles, tile_rows=3)
    want, want_lse = packed_attention_reference(*tiled.args(), return_lse=True)
    for sealed in (True, False):
        out, lse = packed_attention_triton(*tiled.args(), sealed=sealed, **kw)
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    # the probe, on decode rows: break the maps inside whole groups below every row's position
    probe = [(c, d, pos) for c, d, pos in rows if c == 0 and pos == 149]
    case = _case(5, [150, 100, 80], ["sealed", "sealed", "open"], probe, 4, 2, 32, dtype, keep=1.0, shift=False)
    kw = dict(return_lse=True, block_n=block_n, num_splits=1)
    clean, _ = packed_attention_triton(*case.args(), **kw)
    j = torch.arange(128, device=DEVICE)
    inside = j[j % 64 != 63]
    maps = case.packed.row_maps.clone()
    maps[0, :, inside] = -1
    broken = dataclasses.replace(case, packed=dataclasses.replace(case.packed, row_maps=maps))
    out, _ = packed_attention_triton(*broken.args(), **kw)
    _same(out, clean)
    general, _ = packed_attention_triton(*broken.args(), sealed=False, **kw)
    assert not torch.equal(general, clean)


_GROUP_PASS_CASES = [(torch.bfloat16, 96, 32), (torch.float32, 32, 32), (torch.bfloat16, 128, 64)]


@pytest.mark.parametrize("dtype, dim, block_n",
                         _GROUP_PASS_CASES if torch.cuda.is_available() else _GROUP_PASS_CASES[:1])
def test_read_keys_group_pass(dtype, dim, block_n):
    """`read_keys`'s group pass (whole 64-key groups a row reads reconstructed from dense
    planes, decoded straight from their records) and its gather kernel for the rest: every
    key bit for bit as the reference reads it, as without the pass, on dense planes with
    seals below, at and above the rows and NEVER. A probe shows the pass takes the groups:
    row maps broken inside whole sealed groups (not at their last key, which it checks)
    change nothing it reads, and what the gather alone reads. (Under the interpreter, about
    30 s a case, the first case alone: bf16 rounded by hand, a padded head dim; the GPU
    runs all.)"""
    rows = [(0, d, pos) for d in range(PLANES) for pos in (149, 130, 70)] + [(1, 3, 99), (1, 0, 64), (2, 2, 79)]
    case = _case(5, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, dim, dtype, keep=1.0, shift=False)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    want_k, want_v = read_keys_reference(*case.storage(), 150)
    for groups in (True, False):
        k, v = read_keys_triton(*case.storage(), 150, groups=groups, block_n=block_n)
        _same(k, want_k)
        _same(v, want_v)
    probe = [(0, d, 149) for d in range(PLANES)]
    case = _case(5, [150, 100, 80], ["sealed", "sealed", "open"], probe, 4, 2, dim, dtype, keep=1.0, shift=False)
    clean = read_keys_triton(*case.storage(), 150, block_n=block_n)
    j = torch.arange(128, device=DEVICE)
    maps = case.packed.row_maps.clone()
    maps[0, :, j[j % 64 != 63]] = -1
    broken = dataclasses.replace(case, packed=dataclasses.replace(case.packed, row_maps=maps))
    got = read_keys_triton(*broken.storage(), 150, block_n=block_n)
    gather = read_keys_triton(*broken.storage(), 150, groups=False, block_n=block_n)
    for n in range(len(probe)):
        for part in (0, 1):
            _same(got[part][n, :128], clean[part][n, :128])
            assert not torch.equal(gather[part][n, :128], clean[part][n, :128])


@pytest.mark.parametrize("dtype, dim, splits", [(torch.float32, 32, 1), (torch.bfloat16, 64, 3),
                                                 (torch.bfloat16, 128, 2), (torch.bfloat16, 96, 2),
                                                 (torch.float32, 40, 1)])
def test_one_lane_pass_reads_dense_sealed_groups(dtype, dim, splits):
    """GQA 1 (Ouro's heads): one-row tiles' sealed groups go to the one-lane pass on CUDA
    cores (`packed_sealed_row`: codes as units 1 + c / 256 or 1 + c / 16 with the biases
    taken off, or in fp32 the codes themselves), longer tiles' to the tensor-core pass;
    both within the reference's tolerance, on decode rows, one-row tiles and a mix of one-
    and three-row tiles with padding. A probe shows the one-lane pass reads the groups (no
    other sealed pass runs without tiles): row maps broken inside sealed groups change
    nothing it reads, and the general kernel's output."""
    rows = [(0, d, pos) for d in range(PLANES) for pos in (149, 130, 70)] + [(1, 3, 99), (1, 0, 64), (2, 2, 79)]
    case = _case(7, [150, 100, 80], ["mixed", "sealed", "open"], rows, 2, 2, dim, dtype, keep=1.0, shift=False)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    kw = dict(return_lse=True, num_splits=splits)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    for how in (dict(), dict(sealed_row=False)):
        out, lse = packed_attention_triton(*case.args(), **how, **kw)
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    # tiles: one-row ones for the rows of cells 1 and 2, three-row ones for cell 0, a padding tile
    offsets = case.table_offset.tolist()
    tiles = [[i, 1, offsets[i]] for i in range(12, len(rows))] + [[0, 0, 0]]
    tiles += [[first, 3, offsets[first]] for first in range(0, 12, 3)]
    tiles = torch.tensor(tiles, dtype=torch.int32, device=DEVICE)
    out, lse = packed_attention_triton(*case.args(), tiles=tiles, tile_rows=3, **kw)
    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    # the probe
    probe = [(0, d, 149) for d in range(PLANES)]
    case = _case(7, [150, 100, 80], ["sealed", "sealed", "open"], probe, 2, 2, dim, dtype, keep=1.0, shift=False)
    kw = dict(return_lse=True, num_splits=1)
    clean, _ = packed_attention_triton(*case.args(), **kw)
    j = torch.arange(128, device=DEVICE)
    maps = case.packed.row_maps.clone()
    maps[0, :, j[j % 64 != 63]] = -1
    broken = dataclasses.replace(case, packed=dataclasses.replace(case.packed, row_maps=maps))
    out, _ = packed_attention_triton(*broken.args(), **kw)
    _same(out, clean)
    general, _ = packed_attention_triton(*broken.args(), sealed=False, **kw)
    assert not torch.equal(general, clean)


def test_packed_splits_split_long_contexts_of_few_programs():
    """More splits than the BF16 kernel's for a few programs on a long context (the H200
    sweep's batch-1 choices), the same as its choice for a full grid or a short context."""
    assert packed_splits(1, 16, 8192, 132) == choose_splits(1, 16, 8192, 132) == 17
    assert packed_splits(1, 16, 32768, 132) == 64
    assert packed_splits(8, 16, 32768, 132) == 8  # capped at 8 waves of programs
    assert packed_splits(128, 16, 32768, 132) == choose_splits(128, 16, 32768, 132) == 1
    assert packed_splits(1, 16, 1024, 132) == choose_splits(1, 16, 1024, 132)


@pytest.mark.parametrize("splits, block_n", [(1, 32), (3, 32), (4, 64)])
def test_kernel_splits_and_key_blocks(splits, block_n):
    """MHA, fp16, page size 8: split-KV with splits past short rows' keys."""
    rows = [(0, 3, 149), (0, 1, 3), (1, 2, 60), (2, 0, 79)]
    case = _case(11, [150, 100, 80], ["mixed", "sealed", "open"], rows, 2, 2, 16, torch.float16, page_size=8)
    out, lse = packed_attention_triton(*case.args(), return_lse=True, num_splits=splits, block_n=block_n)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    torch.testing.assert_close(out.float(), want.float(), atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def _poisoned(case: Case, first: int, count: int = 1) -> Case:
    """The case of rows first .. first + count - 1 alone, in which everything none of them
    reads is NaN (tail slots no row reads exact, K / V parameters of records and rows no row
    reads reconstructed) or garbage codes; seals, group tables and row maps stay."""
    pk = case.packed
    keep_slot = torch.zeros(case.k_tail.shape[0], dtype=torch.bool, device=DEVICE)
    keep_rec = torch.zeros(pk.seal.shape[0], dtype=torch.bool, device=DEVICE)
    keep_pair = torch.zeros(pk.seal.shape[0], 32, dtype=torch.bool, device=DEVICE)
    keep_v = torch.zeros(pk.seal.shape[0] * 64, dtype=torch.bool, device=DEVICE)
    for n in range(first, first + count):
        c, d, pos, off = (int(x[n]) for x in (case.cell, case.depth, case.position, case.table_offset))
        if pos < 0:
            continue
        j = torch.arange(pos + 1, device=DEVICE)
        sealed = pos >= key_seals(case.packed, c, d, j)
        exact = j[~sealed]
        keep_slot[case.tables[off + exact // case.page_size].long() * case.page_size + exact % case.page_size] = True
        for p in range(d + 1):
            r = pk.row_maps[c, p, j[sealed]].long()
            r = r[r >= 0]
            rec = pk.group_tables[c, p, r // 64].long()
            keep_rec[rec] = True
            keep_pair[rec, r % 64 // 2] = True
            keep_v[rec * 64 + r % 64] = True
    nan = float("nan")
    k = dataclasses.replace(pk.k, codes=pk.k.codes.masked_fill(~keep_pair[:, :, None, None], 0xFF),
                            scale=pk.k.scale.masked_fill(~keep_rec[:, None, None], nan),
                            lo=pk.k.lo.masked_fill(~keep_rec[:, None, None], nan))
    v = dataclasses.replace(pk.v, codes=pk.v.codes.masked_fill(~keep_v[:, None, None], 0xFF),
                            scale=pk.v.scale.masked_fill(~keep_v[:, None, None], nan),
                            lo=pk.v.lo.masked_fill(~keep_v[:, None, None], nan))
    some = slice(first, first + count)
    return Case(case.q[some], case.k_tail.masked_fill(~keep_slot[:, None, None], nan),
                case.v_tail.masked_fill(~keep_slot[:, None, None], nan), case.tables, case.page_size,
                PackedKV(k, v, pk.seal, pk.group_tables, pk.row_maps), case.cell[some], case.depth[some],
                case.position[some], case.table_offset[some])


# Under the interpreter (about 12 s a case) the two poisoning tests split the dtypes
# between them; the GPU runs both dtypes in each.
ROW_POISON_DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.bfloat16]
TILE_POISON_DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]


@pytest.mark.parametrize("dtype", ROW_POISON_DTYPES)
def test_nothing_a_row_does_not_read_reaches_it(dtype):
    """Per row: NaN / garbage everywhere it does not read; the kernel (split, short key
    blocks) and the reference still give the clean result, without a NaN."""
    rows = [(0, 3, 149), (0, 0, 120), (0, 2, 97), (1, 1, 70), (2, 3, 79)]
    case = _case(3, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, 16, dtype)
    assert {"exact", "reconstructed", "mixed"} <= set(_reads(case))
    kernel = dict(return_lse=True, num_splits=2, block_n=32)
    clean = (packed_attention_triton(*case.args(), **kernel), packed_attention_reference(*case.args(), return_lse=True))
    for n in range(len(rows)):
        bad = _poisoned(case, n)
        dirty = (packed_attention_triton(*bad.args(), **kernel),
                 packed_attention_reference(*bad.args(), return_lse=True))
        for (got, lse), (want, want_lse) in zip(dirty, clean):
            assert not got.isnan().any() and not lse.isnan().any()
            torch.testing.assert_close(got, want[n:n + 1], atol=0, rtol=0)
            torch.testing.assert_close(lse, want_lse[n:n + 1], atol=0, rtol=0)
        k, v = read_keys(*bad.storage(), rows[n][2] + 1, use_triton=True)
        assert not k.isnan().any() and not v.isnan().any()


def test_padding_rows_are_not_written_and_dispatch():
    rows = [(0, 1, 50), (1, 0, 20), (2, 2, 30)]
    case = _case(4, [60, 40, 40], ["mixed", "sealed", "open"], rows, 4, 2, 16, torch.float32)
    case.position[1] = -1
    sentinel = torch.full_like(case.q, 7.0)
    out, lse = packed_attention(*case.args(), return_lse=True, out=sentinel)  # the kernel under the interpreter
    assert torch.equal(out[1], torch.full_like(case.q[1], 7.0))
    want, want_lse = packed_attention(*case.args(), return_lse=True, use_triton=False)
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[[0, 2]], want_lse[[0, 2]], atol=1e-5, rtol=1e-5)


# --- query tiles ------------------------------------------------------------------------

def _cut(case: Case, tile_rows: int, padding: tuple[int, ...] = (1, 4)) -> torch.Tensor:
    """Tiles [M, 3] of at most tile_rows rows over each run of consecutive rows sharing cell,
    depth and table offset, with tiles of 0 rows inserted at the indices `padding`."""
    keys = list(zip(case.cell.tolist(), case.depth.tolist(), case.table_offset.tolist()))
    tiles, start = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            tiles += [[s, min(tile_rows, i - s), keys[start][2]] for s in range(start, i, tile_rows)]
            start = i
    for at in padding:
        tiles.insert(at, [0, 0, 0])
    return torch.tensor(tiles, dtype=torch.int64, device=DEVICE)


def _tile_reads(case: Case, tiles: torch.Tensor) -> list[str]:
    """Per tile of rows: "reconstructed" or "exact" (what every (query, key) pair reads),
    "straddle" (a key some rows read reconstructed and others exact: a mixed block) or
    "mixed" (both kinds, each key read one way)."""
    kinds = []
    for first, rows, _ in tiles.tolist():
        if rows == 0:
            continue
        c, d = int(case.cell[first]), int(case.depth[first])
        top = int(case.position[first:first + rows].max())
        j = torch.arange(top + 1, device=DEVICE)
        seal = key_seals(case.packed, c, d, j)
        recon = torch.zeros_like(j, dtype=torch.bool)
        exact = torch.zeros_like(recon)
        for pos in case.position[first:first + rows].tolist():
            recon |= (j <= pos) & (pos >= seal)
            exact |= (j <= pos) & (pos < seal)
        kinds.append("straddle" if (recon & exact).any() else "mixed" if recon.any() and exact.any()
                     else "reconstructed" if recon.any() else "exact")
    return kinds


def _tiled_rows() -> list[tuple[int, int, int]]:
    """A prompt chunk (16 consecutive positions) and a window (increasing, with gaps) in the
    mixed cell 0, a chunk and a window in the sealed cell 1, a chunk in the open cell 2, and
    a lone row."""
    return ([(0, 2, p) for p in range(114, 130)] + [(0, 3, p) for p in (40, 47, 64, 65, 90, 120, 149)]
            + [(1, 1, p) for p in range(30, 35)] + [(1, 3, p) for p in (5, 50, 99)]
            + [(2, 0, p) for p in range(70, 76)] + [(0, 0, 7)])


GQA, MHA = (4, 2, 16, 8), (2, 2, 32, 5)  # heads, KV heads, head dim, tile rows


@pytest.mark.parametrize("shape, dtype, splits", [(GQA, torch.float32, 1), (GQA, torch.bfloat16, 3),
                                                  (MHA, torch.float32, 3), (MHA, torch.bfloat16, 1)],
                         ids=["gqa-fp32-1", "gqa-bf16-3", "mha-fp32-3", "mha-bf16-1"])
def test_tiles_match_reference(shape, dtype, splits):
    """Tiles of 1..tile_rows rows (GQA x 8 rows fills M = 16; MHA x 5 pads it), straddling
    seals, fully sealed and fully exact, with padding tiles; every row is covered. Pairwise:
    each shape with each dtype and each split count."""
    heads, kv_heads, dim, tile_rows = shape
    case = _case(21, [150, 100, 80], ["mixed", "sealed", "open"], _tiled_rows(), heads, kv_heads, dim, dtype)
    tiles = _cut(case, tile_rows)
    sizes = {rows for _, rows, _ in tiles.tolist()}
    assert {0, 1, tile_rows} <= sizes and len(sizes) > 3
    assert {"straddle", "reconstructed", "exact"} <= set(_tile_reads(case, tiles))
    out, lse = packed_attention_triton(*case.args(), tiles=tiles, tile_rows=tile_rows, return_lse=True,
                                       num_splits=splits)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])


def test_tiles_keep_scores():
    """STORE_SCORES over query tiles (straddling seals, padding lanes of GQA 3, padding
    tiles, 3 splits): each scored row's scaled scores of keys 0..pos, within LSE_TOLERANCE
    of the reference's, clipped to the scores rows' 128 keys; nothing past a row's position
    or outside its scores row is written (guard rows on both sides of the scores); the
    output and lse are bit for bit those of a launch that keeps none."""
    dtype, tile_rows = torch.bfloat16, 4
    case = _case(21, [150, 100, 80], ["mixed", "sealed", "open"], _tiled_rows(), 6, 2, 16, dtype)
    tiles = _cut(case, tile_rows)
    assert "straddle" in _tile_reads(case, tiles)
    n = case.q.shape[0]
    scored = list(range(0, n, 2))
    score_rows = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    score_rows[scored] = torch.arange(len(scored), dtype=torch.int32, device=DEVICE)
    kernel = dict(tiles=tiles, tile_rows=tile_rows, return_lse=True, num_splits=3)
    plain, plain_lse = packed_attention_triton(*case.args(), **kernel)
    kept = {}
    for name in ("triton", "reference"):
        guarded = torch.full((len(scored) + 2, 6, 128), -7.0, device=DEVICE)
        fn = packed_attention_triton if name == "triton" else packed_attention_reference
        kept[name] = guarded, fn(*case.args(), **kernel, scores=guarded[1:-1], score_rows=score_rows)
    guarded, (out, lse) = kept["triton"]
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    assert (guarded[0] == -7).all() and (guarded[-1] == -7).all(), "a row wrote outside its scores row"
    want = kept["reference"][0]
    for r, i in enumerate(scored, start=1):
        keys = min(int(case.position[i]) + 1, 128)
        assert (guarded[r, :, keys:] == -7).all()
        torch.testing.assert_close(guarded[r, :, :keys], want[r, :, :keys], atol=LSE_TOLERANCE[dtype],
                                   rtol=LSE_TOLERANCE[dtype])
    assert any(int(case.position[i]) + 1 > 128 for i in scored)  # some rows clipped


@pytest.mark.parametrize("dtype", TILE_POISON_DTYPES)
def test_nothing_a_tile_does_not_read_reaches_it(dtype):
    """Per tile: NaN / garbage everywhere no (query, key) pair of its rows reads; the kernel
    gives the clean result bit for bit, without a NaN (straddling, sealed and exact tiles)."""
    rows = ([(0, 3, p) for p in range(96, 104)] + [(0, 1, p) for p in (20, 64, 100, 149)]
            + [(1, 2, p) for p in range(40, 44)] + [(2, 3, p) for p in range(60, 63)])
    case = _case(3, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, 16, dtype)
    tiles = _cut(case, 4, padding=())
    assert {"straddle", "reconstructed", "exact"} <= set(_tile_reads(case, tiles))
    kernel = dict(tile_rows=4, return_lse=True, num_splits=2, block_n=32)
    clean, clean_lse = packed_attention_triton(*case.args(), tiles=tiles, **kernel)
    for first, count, table in tiles.tolist():
        bad = _poisoned(case, first, count)
        got, lse = packed_attention_triton(*bad.args(), tiles=torch.tensor([[0, count, table]], device=DEVICE),
                                           **kernel)
        assert not got.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(got, clean[first:first + count], atol=0, rtol=0)
        torch.testing.assert_close(lse, clean_lse[first:first + count], atol=0, rtol=0)


def test_tiles_leave_other_rows_and_dispatch():
    """Rows no tile covers and padding rows inside a tile are not written; the dispatcher
    takes tiles to either side; the reference rejects a tile mixing depths."""
    rows = [(0, 1, p) for p in (10, 11, 12, 50)] + [(1, 0, 20), (2, 2, 30)]
    case = _case(4, [60, 40, 40], ["mixed", "sealed", "open"], rows, 4, 2, 16, torch.float32)
    case.position[2] = -1
    tiles = torch.tensor([[0, 4, int(case.table_offset[0])], [0, 0, 0], [5, 1, int(case.table_offset[5])]],
                         device=DEVICE)
    for split in (1, 2):
        sentinel = torch.full_like(case.q, 7.0)
        out, lse = packed_attention(*case.args(), tiles=tiles, tile_rows=4, return_lse=True, num_splits=split,
                                    out=sentinel)
        assert torch.equal(out[[2, 4]], torch.full_like(case.q[[2, 4]], 7.0))
        want, want_lse = packed_attention(*case.args(), tiles=tiles, tile_rows=4, return_lse=True,
                                          use_triton=False)
        assert torch.equal(want[[2, 4]], torch.zeros_like(want[[2, 4]])) and want_lse[[2, 4]].isinf().all()
        done = [0, 1, 3, 5]
        torch.testing.assert_close(out[done], want[done], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[done], want_lse[done], atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="one cell, depth"):
        packed_attention_reference(*case.args(), tiles=torch.tensor([[3, 2, 0]], device=DEVICE), tile_rows=2)


@pytest.mark.parametrize("heads, dtype", [(2, torch.float32), (4, torch.bfloat16)])
def test_min_split_keys_reads_like_reference(heads, dtype):
    """With `min_split_keys` (the engine's graphs launch the splits of the longest context and
    a shorter one takes fewer) splits past a row's context read nothing and the three passes
    (one-lane for GQA 1, tensor-core for GQA 2, the general kernel after them) still agree on
    each split's keys: decode rows and three-row tiles, 8 splits of at least 128 keys over
    contexts up to 150 (two splits read, six do not), within the reference's tolerance."""
    rows = [(0, d, pos) for d in range(PLANES) for pos in (149, 130, 70)] + [(1, 3, 99), (1, 0, 64), (2, 2, 79)]
    case = _case(11, [150, 100, 80], ["mixed", "sealed", "open"], rows, heads, 2, 64, dtype, keep=1.0, shift=False)
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    kw = dict(return_lse=True, num_splits=8, block_n=64, min_split_keys=128)
    offsets = case.table_offset.tolist()
    tiles = torch.tensor([[first, 3, offsets[first]] for first in range(0, 12, 3)]
                         + [[i, 1, offsets[i]] for i in range(12, len(rows))], dtype=torch.int32, device=DEVICE)
    for how in (dict(), dict(tiles=tiles, tile_rows=3), dict(sealed=False)):
        out, lse = packed_attention_triton(*case.args(), **how, **kw)
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    with pytest.raises(AssertionError, match="min_split_keys"):
        packed_attention_triton(*case.args(), **dict(kw, min_split_keys=96))


def _seals_past_rows(case: Case, gap: int) -> Case:
    """The case with every record's seal raised to at least its last row's position + gap
    (what the engine's seals keep: a group seals `tail` or more past its last row)."""
    maps, tables = case.packed.row_maps.cpu(), case.packed.group_tables.cpu()
    seal = case.packed.seal.cpu().clone()
    for c in range(maps.shape[0]):
        for p in range(maps.shape[1]):
            positions = (maps[c, p] >= 0).nonzero().flatten()
            for pos in positions.tolist():
                rec = int(tables[c, p, int(maps[c, p, pos]) // 64])
                if rec >= 0 and seal[rec] < NEVER:
                    seal[rec] = max(int(seal[rec]), pos + gap)
    return dataclasses.replace(case, packed=dataclasses.replace(case.packed, seal=seal.to(DEVICE)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_gap_skips_the_gather_near_the_rows(dtype):
    """With `exact_gap` (the engine passes its tail: a group seals at least that far past its
    last row) key blocks lying within it of every row of a tile are read exact without the
    row maps and seals: within the reference's tolerance on decode rows and tiles, with splits
    and with the sealed passes off, on planes whose seals keep the gap; on planes whose seals
    do not (sealed at 0), the rows then read those keys exact where the reference reads them
    reconstructed, which shows the blocks take the shortcut."""
    gap = 40
    rows = [(0, d, pos) for d in range(PLANES) for pos in (149, 130, 70)] + [(1, 3, 99), (1, 0, 64), (2, 2, 79)]
    case = _seals_past_rows(_case(13, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, 32, dtype), gap)
    assert {"exact", "mixed"} <= set(_reads(case))
    want, want_lse = packed_attention_reference(*case.args(), return_lse=True)
    for how in (dict(num_splits=1), dict(num_splits=3, sealed=False), dict(num_splits=2, block_n=64)):
        out, lse = packed_attention_triton(*case.args(), return_lse=True, exact_gap=gap, **how)
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        torch.testing.assert_close(lse, want_lse, atol=LSE_TOLERANCE[dtype], rtol=LSE_TOLERANCE[dtype])
    sealed = _case(13, [150, 100, 80], ["sealed", "sealed", "sealed"], rows, 4, 2, 32, dtype)
    want, _ = packed_attention_reference(*sealed.args(), return_lse=True)
    out, _ = packed_attention_triton(*sealed.args(), sealed=False, exact_gap=gap)
    torch.testing.assert_close(packed_attention_triton(*sealed.args(), sealed=False)[0].float(), want.float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert (out.float() - want.float()).abs().max() > 10 * TOLERANCE[dtype]
