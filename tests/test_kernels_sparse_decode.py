"""Sparse decode attention (RFC 3.2): the torch references against the FlashLoop reference
pieces, and the Triton kernels against the references, on random paged caches and a
slot-indexed state.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). Each case holds a few decode rows at different,
unsorted positions (context 1 to 200 keys, some rows padding), each with its own shuffled
page tables for depth 2 (the source) and depth 3 (the correction) over one pool, and its own
token slot in a state with more slots than rows. `dense` (the caller's loop-2 attention) is
the rows' true loop-2 attention, computed in fp64 and rounded to the dtype.

Tolerances (absolute and relative alike):
- references vs `flashloop_reference` (fp64 inputs): kept key sets and counts equal, values
  1e-12 (REFERENCE_TOL);
- Triton vs reference: fp32 inputs 1e-5 for mass and c_ref and the corrected outputs;
  bf16 / fp16 inputs 1e-4 for mass and c_ref (both sides compute in fp32 from the same
  rounded values) and 2e-2 for the corrected outputs, rounded to the dtype (STATE_TOL,
  OUT_TOL); o_ref is dense in fp32, exactly, on both sides;
- kept key sets are compared for equality only on inputs where, in every row and head, the
  b-th and (b+1)-th largest probabilities differ by more than 1e-5 relative in fp64 (GAP;
  fp32 P carries about 1e-6 relative error; the kept set is stored in position order, so
  the order within it does not matter); other draws are redrawn. Ties are tested
  separately with exactly equal scores (dyadic inputs, every product and sum exact);
- key_retention 1.0: the correction equals dense attention at depth 3 to 1e-12 (fp64
  reference) and 1e-5 (fp32 kernel).
Small kernel blocks (`SMALL`) make the select passes, the gathers and the scores splits
run over several blocks at these short contexts.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from specloop.kernels.sparse_decode_common import (
    Blocks, PackedRows, SlotState, _use_triton, check_capacity, key_budget, key_budgets,
)
from specloop.kernels.sparse_decode_correction import correction_reference, correction_triton, decode_correction
from specloop.kernels.sparse_decode_source import (
    decode_select, decode_source, scratch_keys, scratch_rows, source_reference, source_triton,
)
from specloop.kernels.packed_attention import packed_attention
from specloop.kernels.packed_keys import read_keys
from specloop.kernels.paged_attention import block_g, paged_attention
from tests.test_kernels_packed_attention import _case as _packed_case
from specloop.model.flashloop_reference import (
    _causal_probs, _per_head, corrected_attention, decode_budget, decode_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCE_TOL = 1e-12
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
GAP = 1e-5
POSITIONS = [150, 0, 29, 199, 5, 99]  # unsorted; n = 1, a short row, 10% of 30 exact, ...
PADDED = [150, -1, 0, 29, 199, -1, 5, 99]  # the same rows with padding rows between them
MAX_CONTEXT = 200
PAD_SLOT = 1 << 40  # a padding row's slot: never dereferenced
SMALL = Blocks(scores=16, select=32, gather=16, correction=16, splits=3, correction_splits=3)  # split paths
SLOT_FIELDS = ("keys", "count", "mass", "o_ref", "c_ref")


@dataclasses.dataclass
class Case:
    q2: torch.Tensor  # [N, Hq, D] loop-2 queries
    q3: torch.Tensor  # [N, Hq, D] loop-3 queries
    k: torch.Tensor  # [S, Hkv, D] one layer's pool
    v: torch.Tensor
    tables: torch.Tensor  # flat page tables, int32
    positions: torch.Tensor
    off2: torch.Tensor  # each row's depth-2 table offset
    off3: torch.Tensor  # each row's depth-3 table offset
    page_size: int
    slots: torch.Tensor  # [N] int64, each row's token slot (PAD_SLOT for padding rows)
    num_slots: int
    dense: torch.Tensor | None = None  # [N, Hq, D] loop-2 attention (zeros on padding rows)

    def source_args(self) -> tuple:
        return self.q2, self.k, self.v, self.tables, self.positions, self.off2, self.page_size

    def correction_args(self) -> tuple:
        return self.q3, self.k, self.v, self.tables, self.positions, self.off3, self.page_size

    def state(self, capacity: int, dtype: torch.dtype = torch.float32) -> SlotState:
        return SlotState.zeros(self.num_slots, self.q2.shape[1], self.q2.shape[2], capacity, dtype=dtype,
                               device=DEVICE)


def _case(seed: int, positions: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 32, page_size: int = 16,
          dtype: torch.dtype = torch.float32, pages: int = 48, spare_slots: int = 3) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n = len(positions)
    pages = max(pages, -(-MAX_CONTEXT // page_size))
    k = torch.randn(pages * page_size, kv_heads, dim, generator=gen)
    v = torch.randn(pages * page_size, kv_heads, dim, generator=gen)
    q2, q3 = torch.randn(n, heads, dim, generator=gen), torch.randn(n, heads, dim, generator=gen)
    tables, off2, off3 = [], [], []
    for pos in positions:
        need = max(1, -(-(pos + 1) // page_size))
        for offsets in (off2, off3):
            offsets.append(len(tables))
            tables.extend(torch.randperm(pages, generator=gen)[:need].tolist())
    slots = torch.randperm(n + spare_slots, generator=gen)[:n]
    slots = torch.where(torch.tensor(positions) < 0, PAD_SLOT, slots)
    to = dict(device=DEVICE)
    case = Case(q2.to(dtype).to(**to), q3.to(dtype).to(**to), k.to(dtype).to(**to), v.to(dtype).to(**to),
                torch.tensor(tables, dtype=torch.int32, **to), torch.tensor(positions, **to),
                torch.tensor(off2, **to), torch.tensor(off3, **to), page_size, slots.to(**to), n + spare_slots)
    return dataclasses.replace(case, dense=_loop2_attention(case))


def _rows_kv(cache: torch.Tensor, case: Case, offset: int, pos: int) -> torch.Tensor:
    """A row's keys 0..pos read through its page table: [pos + 1, Hkv, D]."""
    j = torch.arange(pos + 1, device=cache.device)
    return cache[case.tables[offset + j // case.page_size].long() * case.page_size + j % case.page_size]


def _loop2_attention(case: Case) -> torch.Tensor:
    """Each row's dense loop-2 attention in fp64, rounded to the dtype; zeros on padding rows."""
    heads = case.q2.shape[1]
    out = torch.zeros_like(case.q2)
    for i, pos in enumerate(case.positions.tolist()):
        if pos >= 0:
            at = case.positions[i:i + 1]
            k2 = _per_head(_rows_kv(case.k, case, int(case.off2[i]), pos), heads).double()
            v2 = _per_head(_rows_kv(case.v, case, int(case.off2[i]), pos), heads).double()
            probs = _causal_probs(case.q2[i:i + 1].double(), at, k2)[:, 0]  # [Hq, n]
            out[i] = torch.einsum("hn,nhd->hd", probs, v2).to(case.q2.dtype)
    return out


def _flashloop_row(case: Case, i: int, retention: float):
    """FlashLoop's loop-2 reference and loop-3 corrected output for row i, plus its loop-2
    probabilities [Hq, n] and dense loop-3 attention (for retention 1)."""
    heads, dim = case.q2.shape[1], case.q2.shape[2]
    pos = int(case.positions[i])
    at = case.positions[i:i + 1]
    k2 = _per_head(_rows_kv(case.k, case, int(case.off2[i]), pos), heads)  # [n, Hq, D]
    v2 = _per_head(_rows_kv(case.v, case, int(case.off2[i]), pos), heads)
    k3 = _per_head(_rows_kv(case.k, case, int(case.off3[i]), pos), heads).transpose(0, 1)  # [Hq, n, D]
    v3 = _per_head(_rows_kv(case.v, case, int(case.off3[i]), pos), heads).transpose(0, 1)
    probs = _causal_probs(case.q2[i:i + 1], at, k2)[:, 0]  # [Hq, n]
    ref = decode_reference(probs, v2.transpose(0, 1).to(probs.dtype), decode_budget(pos + 1, retention))
    index = ref.keys[..., None].expand(-1, -1, dim)
    acc = probs.dtype
    scores = torch.einsum("hd,hbd->hb", case.q3[i].to(acc), k3.gather(1, index).to(acc)) * dim ** -0.5
    corrected = corrected_attention(ref.o_ref, ref.c_ref, ref.mass, scores, v3.gather(1, index).to(acc))
    dense3 = torch.einsum("hn,hnd->hd", _causal_probs(case.q3[i:i + 1], at, k3.transpose(0, 1))[:, 0], v3.to(acc))
    return ref, corrected, probs, dense3


def _well_separated(case: Case, retention: float) -> bool:
    """Every row and head: the b-th and (b+1)-th largest probabilities differ by more than
    GAP relative (fp64 over the case's rounded inputs)."""
    wide = dataclasses.replace(case, q2=case.q2.double(), q3=case.q3.double(), k=case.k.double(), v=case.v.double())
    for i, pos in enumerate(case.positions.tolist()):
        b = decode_budget(pos + 1, retention)
        if pos < 0 or b == pos + 1:
            continue
        _, _, probs, _ = _flashloop_row(wide, i, retention)
        top = probs.sort(-1, descending=True).values
        if ((top[:, b - 1] - top[:, b]) <= GAP * top[:, b - 1]).any():
            return False
    return True


def _separated_case(seed: int, retention: float, positions: list[int] = PADDED, **kw) -> Case:
    for attempt in range(20):
        case = _case(seed * 100 + attempt, positions, **kw)
        if _well_separated(case, retention):
            return case
    raise AssertionError("no well-separated draw in 20 seeds")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.to(want.dtype), want, atol=tol, rtol=tol)


def _kept(state: SlotState, slot: int) -> torch.Tensor:
    """A slot's kept keys per head [Hq, count]."""
    return state.keys[slot, :, : int(state.count[slot])]


def _state_close(got: SlotState, want: SlotState, case: Case, dtype: torch.dtype, retention: float) -> None:
    """The slots of the case's rows: equal counts and kept keys, close statistics; o_ref is
    dense in fp32, exactly."""
    for i, pos in enumerate(case.positions.tolist()):
        if pos < 0:
            continue
        slot = int(case.slots[i])
        assert int(got.count[slot]) == int(want.count[slot]) == decode_budget(pos + 1, retention)
        assert torch.equal(_kept(got, slot), _kept(want, slot)), f"row {i}"
        for name in ("mass", "c_ref"):
            _close(getattr(got, name)[slot], getattr(want, name)[slot], STATE_TOL[dtype])
        assert torch.equal(got.o_ref[slot], case.dense[i].float()) and torch.equal(want.o_ref[slot], got.o_ref[slot])


def _fill(state: SlotState) -> SlotState:
    """The state with every entry a sentinel (to see what a call writes)."""
    for name in SLOT_FIELDS:
        getattr(state, name).fill_(-7)
    return state


def _clone(state: SlotState) -> SlotState:
    return SlotState(*(getattr(state, name).clone() for name in SLOT_FIELDS))


# --- the references against FlashLoop's pieces ----------------------------------------

@pytest.mark.parametrize("retention", [0.1, 0.25, 0.07])
def test_references_equal_flashloop_pieces(retention):
    """fp64: kept sets (in ascending order), counts and every statistic of each row as
    decode_reference gives them, and the correction as corrected_attention gives it."""
    case = _case(1, POSITIONS, dtype=torch.float64)
    state = case.state(key_budget(MAX_CONTEXT, retention), torch.float64)
    source_reference(*case.source_args(), retention, dense=case.dense, slots=case.slots, state=state,
                     max_context=MAX_CONTEXT)
    out = torch.zeros_like(case.q3)
    correction_reference(*case.correction_args(), slots=case.slots, state=state, out=out)
    for i, pos in enumerate(POSITIONS):
        ref, corrected, _, _ = _flashloop_row(case, i, retention)
        slot = int(case.slots[i])
        assert int(state.count[slot]) == decode_budget(pos + 1, retention)
        assert torch.equal(_kept(state, slot).long(), ref.keys.sort(-1).values)
        for got, want in ((state.mass[slot], ref.mass), (state.o_ref[slot], ref.o_ref),
                          (state.c_ref[slot], ref.c_ref), (out[i], corrected)):
            torch.testing.assert_close(got, want, atol=REFERENCE_TOL, rtol=0)


# --- Triton against the references ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim, page_size, blocks", [
    (4, 2, 32, 16, Blocks()), (4, 4, 16, 8, SMALL), (6, 2, 24, 32, dataclasses.replace(SMALL, radix_bits=11, correction_splits=7)),  # empty splits
])
def test_kernels_match_references(dtype, heads, kv_heads, dim, page_size, blocks):
    retention = 0.1
    case = _separated_case(heads * 10 + dim, retention, heads=heads, kv_heads=kv_heads, dim=dim,
                           page_size=page_size, dtype=dtype)
    capacity = key_budget(MAX_CONTEXT, retention) + 3  # a bucket above every row's budget
    want, got = case.state(capacity), case.state(capacity)
    source_reference(*case.source_args(), retention, dense=case.dense, slots=case.slots, state=want)
    source_triton(*case.source_args(), retention, dense=case.dense, slots=case.slots, state=got,
                  max_context=MAX_CONTEXT, blocks=blocks)
    _state_close(got, want, case, dtype, retention)
    out_got, out_want = torch.zeros_like(case.q3), torch.zeros_like(case.q3)
    correction_triton(*case.correction_args(), slots=case.slots, state=got, out=out_got, blocks=blocks)
    correction_reference(*case.correction_args(), slots=case.slots, state=want, out=out_want)
    _close(out_got.float(), out_want.float(), OUT_TOL[dtype])


def _tie_case(dtype: torch.dtype) -> Case:
    """Dyadic q and K (every product and sum exact in fp32): all heads share one query of
    ones, so every head ranks alike. Row 0 (pos 47, b = 5): key 45 on top, six equal keys
    below it at 5, 12, 20, 24, 31, 38 (a tie kept too many would take 45's place). Row 1
    (pos 19, b = 2): equal top keys at 0, 10, 19."""
    case = _case(5, [47, 19], dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    # Disjoint shuffled pages (3 for row 0, 2 for row 1), so neither row sees the other's keys.
    tables = torch.randperm(48, generator=gen)[:5].to(device=DEVICE, dtype=torch.int32)
    offsets = torch.tensor([0, 3], device=DEVICE)
    case = dataclasses.replace(case, tables=tables, off2=offsets, off3=offsets)
    k = (torch.randint(-1, 2, case.k.shape, generator=gen) * 0.25).to(case.k.device)
    for i, (top, tied) in enumerate([(45, [5, 12, 20, 24, 31, 38]), (None, [0, 10, 19])]):
        rows = _rows_kv(torch.arange(k.shape[0], device=k.device), case, int(case.off2[i]), int(case.positions[i]))
        if top is not None:
            k[rows[top]] = 0.75
        k[rows[tied]] = 0.5
    return dataclasses.replace(case, q2=torch.ones_like(case.q2).to(dtype), q3=case.q3.to(dtype), k=k.to(dtype),
                               v=case.v.to(dtype), dense=case.dense.to(dtype))


def _kept_scores(case: Case, scored: list[int], splits: int, max_context: int = MAX_CONTEXT):
    """The dense launch over the case's real rows at depth 2, keeping the scores of rows
    `scored` (scores row k for the k-th) and every row's lse: (dense, lse, scores, plain
    dense, plain lse), the last two from the same launch without scores."""
    heads = case.q2.shape[1]
    tile_rows = max(1, 16 // block_g(heads, case.k.shape[1]))
    real = [i for i, pos in enumerate(case.positions.tolist()) if pos >= 0]
    tiles = torch.tensor([(i, 1, int(case.off2[i])) for i in real], device=DEVICE).view(-1, 3)
    score_rows = torch.full((case.positions.shape[0],), -1, dtype=torch.int32, device=DEVICE)
    score_rows[scored] = torch.arange(len(scored), dtype=torch.int32, device=DEVICE)
    scores = torch.full((len(scored) + 1, heads, max_context), -7.0, device=DEVICE)
    args = (case.q2, case.k, case.v, case.tables, case.positions, tiles, case.page_size)
    plain, plain_lse = paged_attention(*args, tile_rows=tile_rows, num_splits=splits, return_lse=True)
    dense, lse = paged_attention(*args, tile_rows=tile_rows, num_splits=splits, return_lse=True, scores=scores,
                                 score_rows=score_rows)
    return dense, lse, scores, plain, plain_lse


SPLIT_SELECT = Blocks(split_select=32, gather=16, select_splits=3)  # shares of 96 keys of a 200-key row


@pytest.mark.parametrize("dtype, splits, blocks", [
    (torch.float32, 1, Blocks()), (torch.bfloat16, 3, Blocks()), (torch.float16, 2, Blocks()),
    (torch.float32, 1, SPLIT_SELECT), (torch.bfloat16, 2, SPLIT_SELECT),
    (torch.float32, 3, dataclasses.replace(SPLIT_SELECT, select_splits=7, radix_bits=11)),  # some splits empty
])
def test_scores_kept_by_the_dense_launch_give_the_source_state(dtype, splits, blocks):
    """The fused source: `paged_attention` stores the scored rows' scores and gives their lse,
    then `decode_select` alone (one program per row and head, or split over several) gives
    `source_reference`'s state. Rows with score row -1 (the second source row here) leave
    the scores untouched, and storing them changes neither the output nor the lse."""
    retention = 0.1
    case = _separated_case(41, retention, dtype=dtype)
    real = [i for i, pos in enumerate(PADDED) if pos >= 0]
    scored = [i for i in real if i != real[1]]
    dense, lse, scores, plain, plain_lse = _kept_scores(case, scored, splits)
    assert torch.equal(dense[real], plain[real]) and torch.equal(lse[real], plain_lse[real])
    assert (scores[-1] == -7).all(), "a row without a scores row wrote one"
    for r, i in enumerate(scored):  # keys past a row's position are not written either
        assert (scores[r, :, int(case.positions[i]) + 1:] == -7).all()
    at = torch.tensor(scored, device=DEVICE)
    want = case.state(key_budget(MAX_CONTEXT, retention))
    got = case.state(key_budget(MAX_CONTEXT, retention))
    rows = dataclasses.replace(case, q2=case.q2[at], positions=case.positions[at], off2=case.off2[at],
                               slots=case.slots[at], dense=case.dense[at])
    source_reference(*rows.source_args(), retention, dense=rows.dense, slots=rows.slots, state=want)
    decode_select(case.v, case.tables, rows.positions, rows.off2, case.page_size, retention, dense=rows.dense,
                  lse=lse[at].contiguous(), scores=scores, slots=rows.slots, state=got, max_context=MAX_CONTEXT,
                  blocks=blocks)
    _state_close(got, want, rows, dtype, retention)


def test_kept_scores_never_pass_a_scores_row():
    """A scores row shorter than a row's keys takes the keys it holds; the next row of the
    scratch (the next source's) is not overwritten."""
    case = _case(43, [150, 20])
    heads = case.q2.shape[1]
    tiles = torch.tensor([(0, 1, int(case.off2[0])), (1, 1, int(case.off2[1]))], device=DEVICE)
    scores = torch.full((2, heads, 64), -7.0, device=DEVICE)
    paged_attention(case.q2, case.k, case.v, case.tables, case.positions, tiles, case.page_size,
                    tile_rows=max(1, 16 // block_g(heads, case.k.shape[1])), scores=scores,
                    score_rows=torch.tensor([0, -1], dtype=torch.int32, device=DEVICE))
    assert (scores[1] == -7).all() and (scores[0] != -7).all()


@pytest.mark.parametrize("blocks", [Blocks(), SMALL])
def test_dense_rows_get_dense_attention_and_read_no_state(blocks):
    """Rows set in `dense_rows` (a missing state) get dense attention over their keys at
    that depth, in the Triton kernels (one split or several) and the reference, whatever
    their slot holds; the other rows are corrected as usual."""
    case = _case(45, PADDED)
    capacity = key_budget(MAX_CONTEXT, 0.1)
    state = case.state(capacity)
    source_reference(*case.source_args(), 0.1, dense=case.dense, slots=case.slots, state=state)
    dense_rows = torch.tensor([i % 2 == 0 for i in range(len(PADDED))], device=DEVICE)
    for i, pos in enumerate(PADDED):  # a dense row's slot holds garbage: never read
        if pos >= 0 and bool(dense_rows[i]):
            for name in SLOT_FIELDS:
                getattr(state, name)[int(case.slots[i])] = -7 if name != "count" else 3
    want = torch.zeros_like(case.q3)
    correction_reference(*case.correction_args(), slots=case.slots, state=state, out=want, dense_rows=dense_rows)
    got = torch.zeros_like(case.q3)
    correction_triton(*case.correction_args(), slots=case.slots, state=state, out=got, blocks=blocks,
                      dense_rows=dense_rows)
    _close(got, want, OUT_TOL[torch.float32])
    for i, pos in enumerate(PADDED):
        if pos >= 0 and bool(dense_rows[i]):
            _, _, _, dense3 = _flashloop_row(case, i, 0.1)
            _close(got[i], dense3, OUT_TOL[torch.float32])
        elif pos >= 0:
            assert not torch.equal(got[i], torch.zeros_like(got[i]))


# fp32 and bf16, one split and several; the interpreter (15-30 s a case) runs two of them
PACKED_CASES = [(torch.float32, Blocks()), (torch.bfloat16, SMALL)] + (
    [(torch.float32, SMALL)] if torch.cuda.is_available() else [])
PACKED_ROWS = [(0, 1, 149), (0, 1, 120), (1, 1, 99), (2, 1, 79), (1, 1, 40), (0, 1, 63), (2, 1, 0)]


def _packed_states_agree(got: SlotState, want: SlotState, slots: torch.Tensor, positions: list[int],
                         dtype: torch.dtype) -> None:
    """Rows at `positions` in `slots`: equal counts (each row's budget) and kept keys, mass and
    C_ref within STATE_TOL, O_ref exactly."""
    assert torch.equal(got.count, want.count)
    for k, pos in enumerate(positions):
        slot, b = int(slots[k]), key_budget(pos + 1, 0.1)
        assert int(got.count[slot]) == b
        assert torch.equal(got.keys[slot, :, :b], want.keys[slot, :, :b]), k
    _close(got.mass, want.mass, STATE_TOL[dtype])
    _close(got.c_ref, want.c_ref, STATE_TOL[dtype])
    assert torch.equal(got.o_ref, want.o_ref)


def _same_as_the_copy(got: SlotState, copy: SlotState, dtype: torch.dtype) -> None:
    """The packed kernels' state against the plain kernels' over the reader's copy: bit for
    bit under the interpreter; on the GPU (the packed launches round without FMA) mass and
    C_ref within STATE_TOL."""
    for field in SLOT_FIELDS:
        if DEVICE == "cpu":
            assert torch.equal(getattr(got, field), getattr(copy, field)), field
        elif field in ("mass", "c_ref"):
            _close(getattr(got, field), getattr(copy, field), STATE_TOL[dtype])


def _read_copy(case, keys: int) -> tuple:
    """The Triton reader's copy of the packed case's rows' keys 0..`keys`-1, as a paged pool
    of its own: K, V, tables, offsets."""
    n = case.q.shape[0]
    k, v = read_keys(case.k_tail, case.v_tail, case.tables, case.page_size, case.packed, case.cell, case.depth,
                     case.position, case.table_offset, keys, use_triton=True)
    per_row = keys // case.page_size
    return (k.reshape(n * keys, *k.shape[2:]), v.reshape(n * keys, *v.shape[2:]),
            torch.arange(n * per_row, device=DEVICE), torch.arange(n, device=DEVICE) * per_row)


@pytest.mark.parametrize("dtype, blocks", PACKED_CASES)
def test_source_reads_packed_planes_as_the_rows_read_them(dtype, blocks):
    """With INT4 residual planes (`PackedRows`) the loop-2 source scores every key 0..pos and
    sums V over the kept ones as the row reads them, straight from the planes: the reference
    over a paged copy of the rows' keys gives the same kept keys and counts, mass and C_ref
    within STATE_TOL, O_ref exactly. Under the interpreter it equals, bit for bit, the plain
    kernels over the Triton reader's copy (on the GPU within the tolerance: the packed
    launches round the reconstruction without FMA)."""
    case = _packed_case(11, [150, 100, 80], ["mixed", "sealed", "open"], PACKED_ROWS, 4, 2, 16, dtype)
    n, heads, dim = case.q.shape
    gen = torch.Generator().manual_seed(12)
    slots = torch.randperm(n + 2, generator=gen)[:n].to(DEVICE)
    dense = torch.randn(n, heads, dim, generator=gen).to(dtype).to(DEVICE)
    capacity = key_budget(MAX_CONTEXT, 0.1)
    packed = PackedRows(case.packed, case.cell, case.depth)
    args = (case.q, case.k_tail, case.v_tail, case.tables, case.position, case.table_offset, case.page_size, 0.1)
    states = {}
    for name in ("reference", "packed"):
        states[name] = SlotState.zeros(n + 2, heads, dim, capacity, device=DEVICE)
        if name == "reference":
            decode_source(*args, dense=dense, slots=slots, state=states[name], max_context=MAX_CONTEXT,
                          use_triton=False, packed=packed)
        else:
            source_triton(*args, dense=dense, slots=slots, state=states[name], max_context=MAX_CONTEXT,
                          blocks=blocks, packed=packed)
    got, want = states["packed"], states["reference"]
    _packed_states_agree(got, want, slots, [p for _, _, p in PACKED_ROWS], dtype)
    keys = -(-(max(p for _, _, p in PACKED_ROWS) + 1) // case.page_size) * case.page_size
    k, v, tables, offsets = _read_copy(case, keys)
    plain = SlotState.zeros(n + 2, heads, dim, capacity, device=DEVICE)
    source_triton(case.q, k, v, tables, case.position, offsets, case.page_size, 0.1, dense=dense, slots=slots,
                  state=plain, max_context=MAX_CONTEXT, blocks=blocks)
    _same_as_the_copy(got, plain, dtype)


@pytest.mark.parametrize("dtype, blocks", PACKED_CASES)
def test_correction_reads_packed_planes_as_the_rows_read_them(dtype, blocks):
    """With INT4 residual planes (`PackedRows`) the correction reads each kept key as its
    row reads it, exact from the tail or reconstructed from the packed records, straight
    from the planes: the same output as the reference over a paged copy of the rows' keys
    (`read_keys_reference`), for kept rows and dense rows (a missing state), one split or
    several. Under the interpreter it equals, bit for bit, the plain kernel over the copy
    the Triton reader makes (`read_keys`); on the GPU the packed launch rounds the
    reconstruction without FMA, so the two agree to the tolerance."""
    rows = [(0, 3, 149), (0, 2, 120), (1, 2, 99), (2, 3, 79), (1, 3, 40), (0, 1, 63)]
    case = _packed_case(7, [150, 100, 80], ["mixed", "sealed", "open"], rows, 4, 2, 16, dtype)
    n, heads, dim = case.q.shape
    gen = torch.Generator().manual_seed(8)
    capacity = key_budget(MAX_CONTEXT, 0.3)
    state = SlotState.zeros(n + 2, heads, dim, capacity, device=DEVICE)
    slots = torch.randperm(n + 2, generator=gen)[:n].to(DEVICE)
    for i, (_, _, pos) in enumerate(rows):
        b = key_budget(pos + 1, 0.3)
        slot = int(slots[i])
        state.count[slot] = b
        for h in range(heads):
            state.keys[slot, h, :b] = torch.randperm(pos + 1, generator=gen)[:b].sort().values.to(torch.int32)
        state.mass[slot] = torch.rand(heads, generator=gen)
        state.o_ref[slot] = torch.randn(heads, dim, generator=gen)
        state.c_ref[slot] = torch.randn(heads, dim, generator=gen)
    dense_rows = torch.tensor([i % 3 == 1 for i in range(n)], device=DEVICE)
    packed = PackedRows(case.packed, case.cell, case.depth)
    args = (case.q, case.k_tail, case.v_tail, case.tables, case.position, case.table_offset, case.page_size)
    want = torch.zeros_like(case.q)
    decode_correction(*args, slots=slots, state=state, out=want, use_triton=False, dense_rows=dense_rows,
                      packed=packed)
    got = torch.zeros_like(case.q)
    correction_triton(*args, slots=slots, state=state, out=got, blocks=blocks, dense_rows=dense_rows, packed=packed)
    assert not got.isnan().any()
    _close(got, want, OUT_TOL[dtype])
    assert all(not torch.equal(got[i], torch.zeros_like(got[i])) for i in range(n))
    # the plain kernel over the Triton reader's copy of the keys
    keys = -(-(max(p for _, _, p in rows) + 1) // case.page_size) * case.page_size
    k, v, tables, offsets = _read_copy(case, keys)
    copy = torch.zeros_like(case.q)
    correction_triton(case.q, k, v, tables, case.position, offsets, case.page_size, slots=slots, state=state,
                      out=copy, blocks=blocks, dense_rows=dense_rows)
    if DEVICE == "cpu":
        assert torch.equal(got, copy)
    else:
        _close(got, copy, OUT_TOL[dtype])


def _packed_gap(case) -> float:
    """The smallest relative gap between the b-th and (b+1)-th largest loop-2 probabilities
    over the packed case's rows and heads (fp64 over the keys as each row reads them)."""
    keys = -(-(int(case.position.max()) + 1) // case.page_size) * case.page_size
    k, _v = read_keys(case.k_tail, case.v_tail, case.tables, case.page_size, case.packed, case.cell, case.depth,
                      case.position, case.table_offset, keys, use_triton=False)
    gqa = case.q.shape[1] // k.shape[2]
    worst = float("inf")
    for i, pos in enumerate(case.position.tolist()):
        b = key_budget(pos + 1, 0.1)
        if b < pos + 1:
            s = torch.einsum("hd,lhd->hl", case.q[i].double(), k[i, : pos + 1].double().repeat_interleave(gqa, 1))
            s = s * case.q.shape[2] ** -0.5
            top = s.softmax(-1).sort(-1, descending=True).values
            worst = min(worst, ((top[:, b - 1] - top[:, b]) / top[:, b - 1]).min().item())
    return worst


@pytest.mark.parametrize("dtype, blocks", [(torch.float32, Blocks(select_splits=1)), (torch.bfloat16, SPLIT_SELECT)])
def test_packed_launch_keeps_scores_for_the_select(dtype, blocks):
    """The fused source over INT4 residual planes: `packed_attention` (split) stores the
    scored rows' scores as it reads the keys, within STATE_TOL of the reference's, without
    changing its output or lse (a row with score row -1 and keys past a row's position are
    not written); `decode_select(packed=...)` on them (one program, or split) gives the
    reference's kept keys and counts, mass and C_ref within STATE_TOL, O_ref exactly. Under
    the interpreter it equals, bit for bit, `decode_select` over the Triton reader's copy
    with the same scores and lse."""
    case = _packed_case(11, [150, 100, 80], ["mixed", "sealed", "open"], PACKED_ROWS, 4, 2, 16, dtype)
    n, heads, dim = case.q.shape
    assert _packed_gap(case) > 100 * GAP  # kept sets compare exactly, bf16 tensor-core scores included
    scored = [i for i in range(n) if i != 2]
    score_rows = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    score_rows[scored] = torch.arange(len(scored), dtype=torch.int32, device=DEVICE)
    kept = {}
    for name in ("triton", "reference"):
        kept[name] = torch.full((len(scored) + 1, heads, MAX_CONTEXT), -7.0, device=DEVICE)
        kept[name + " out"] = packed_attention(*case.args(), return_lse=True, num_splits=3, scores=kept[name],
                                               score_rows=score_rows, use_triton=name == "triton")
    plain, plain_lse = packed_attention(*case.args(), return_lse=True, num_splits=3)
    dense, lse = kept["triton out"]
    assert torch.equal(dense, plain) and torch.equal(lse, plain_lse)
    scores = kept["triton"]
    assert (scores[-1] == -7).all(), "a row without a scores row wrote one"
    for r, i in enumerate(scored):
        pos = PACKED_ROWS[i][2]
        assert (scores[r, :, pos + 1:] == -7).all()
        _close(scores[r, :, : pos + 1], kept["reference"][r, :, : pos + 1], STATE_TOL[dtype])
    at = torch.tensor(scored, device=DEVICE)
    packed = PackedRows(case.packed, case.cell[at], case.depth[at])
    slots = torch.randperm(n + 2, generator=torch.Generator().manual_seed(13))[: len(scored)].to(DEVICE)
    rows = (case.position[at], case.table_offset[at], case.page_size, 0.1)
    capacity = key_budget(MAX_CONTEXT, 0.1)
    want, got, copy = (SlotState.zeros(n + 2, heads, dim, capacity, device=DEVICE) for _ in range(3))
    decode_source(case.q[at], case.k_tail, case.v_tail, case.tables, *rows, dense=dense[at], slots=slots,
                  state=want, max_context=MAX_CONTEXT, use_triton=False, packed=packed)
    decode_select(case.v_tail, case.tables, *rows, dense=dense[at], lse=lse[at].contiguous(), scores=scores,
                  slots=slots, state=got, max_context=MAX_CONTEXT, blocks=blocks, k_cache=case.k_tail, packed=packed)
    _packed_states_agree(got, want, slots, [PACKED_ROWS[i][2] for i in scored], dtype)
    keys = -(-(max(p for _, _, p in PACKED_ROWS) + 1) // case.page_size) * case.page_size
    _k, v, tables, offsets = _read_copy(case, keys)
    decode_select(v, tables, case.position[at], offsets[at], case.page_size, 0.1, dense=dense[at],
                  lse=lse[at].contiguous(), scores=scores, slots=slots, state=copy, max_context=MAX_CONTEXT,
                  blocks=blocks)
    _same_as_the_copy(got, copy, dtype)


def test_the_split_select_breaks_ties_across_splits():
    """Row 0's equal keys run over both splits of 32 keys, the last one kept in the first
    split, and its top key sits in the second; padding rows write nothing."""
    case = _tie_case(torch.float32)
    dense, lse, scores, _, _ = _kept_scores(case, [0, 1], 1, max_context=48)
    state = _fill(case.state(5))
    decode_select(case.v, case.tables, case.positions, case.off2, case.page_size, 0.1, dense=dense, lse=lse,
                  scores=scores, slots=case.slots, state=state, max_context=48,
                  blocks=Blocks(split_select=32, gather=16, select_splits=2))
    for i, keys in enumerate([[5, 12, 20, 24, 45], [0, 10]]):
        assert _kept(state, int(case.slots[i])).tolist() == [keys] * case.q2.shape[1]
    want = case.state(5)
    source_reference(*case.source_args(), 0.1, dense=dense, slots=case.slots, state=want)
    for i in range(2):
        slot = int(case.slots[i])
        for name in ("mass", "c_ref", "o_ref"):
            _close(getattr(state, name)[slot], getattr(want, name)[slot], STATE_TOL[torch.float32])


TIE = 1.0
NEAR_TIE = [TIE + 2.0 ** -20, TIE + 2.0 ** -12, TIE + 2.0 ** -5, TIE + 3.0]  # P differs from T's in digit 3, 2, 1, 0


def _tied_scores(seed: int, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [N, Hq, MAX_CONTEXT] for the split select, and their lse: random, but about 40%
    of each row's keys exactly TIE (the threshold's ties run through every split) and, in its
    first 64 keys, keys just above TIE whose P first differs from the tie's in each digit."""
    gen = torch.Generator().manual_seed(seed)
    n, heads = case.q2.shape[:2]
    scores = torch.randn(n, heads, MAX_CONTEXT, generator=gen) * 2
    scores = torch.where(torch.rand(scores.shape, generator=gen) < 0.4, TIE, scores)
    near = torch.randint(0, 64, (n, heads, 3 * len(NEAR_TIE)), generator=gen)
    scores.scatter_(2, near, torch.tensor(NEAR_TIE * 3).expand(n, heads, -1).contiguous())
    lse = torch.zeros(n, heads)
    for i, pos in enumerate(case.positions.tolist()):
        if pos >= 0:
            lse[i] = torch.logsumexp(scores[i, :, : pos + 1], -1)
    return scores.to(DEVICE), lse.to(DEVICE)


def _state_from_scores(state: SlotState, case: Case, scores: torch.Tensor, lse: torch.Tensor,
                       retention: float) -> None:
    """The rows' slots hold the first b keys of a stable descending sort of each head's scores
    (in position order), their m and C_ref within STATE_TOL (fp64 from the same scores), and
    O_ref = dense; every other slot holds `_fill`'s sentinel."""
    heads, dim = case.q2.shape[1:]
    for i, pos in enumerate(case.positions.tolist()):
        if pos < 0:
            continue
        slot, b = int(case.slots[i]), key_budget(pos + 1, retention)
        keys = scores[i, :, : pos + 1].sort(dim=-1, descending=True, stable=True).indices[:, :b].sort(-1).values
        assert int(state.count[slot]) == b and torch.equal(_kept(state, slot).long(), keys), f"row {i}"
        p = (scores[i, :, : pos + 1].double() - lse[i, :, None].double()).exp().gather(1, keys)  # [Hq, b]
        v = _per_head(_rows_kv(case.v, case, int(case.off2[i]), pos), heads).double().transpose(0, 1)
        v = v.gather(1, keys[..., None].expand(-1, -1, dim))  # [Hq, b, D]
        _close(state.mass[slot], p.sum(-1), STATE_TOL[torch.float32])
        _close(state.c_ref[slot], (p[..., None] * v).sum(1), STATE_TOL[torch.float32])
        assert torch.equal(state.o_ref[slot], case.dense[i].float())
    written = {int(case.slots[i]) for i, pos in enumerate(case.positions.tolist()) if pos >= 0}
    for slot in set(range(case.num_slots)) - written:
        for name in SLOT_FIELDS:
            assert (getattr(state, name)[slot] == -7).all(), f"slot {slot} {name}"


@pytest.mark.parametrize("splits, radix_bits, retention", [(3, 8, 0.4), (7, 11, 0.4), (5, 8, 0.1)])
def test_split_offsets_from_digit_histograms_with_ties_across_splits(splits, radix_bits, retention):
    """Each split's offset (the keys above T and equal to it in the earlier splits) comes from
    the earlier splits' digit histograms: with ties at T through every split, and keys above
    T in early splits whose P first differs from T's at each digit, the split select keeps
    the first b keys of a stable descending sort (ties to the lower position)."""
    case = _case(47, PADDED)
    scores, lse = _tied_scores(48, case)
    state = _fill(case.state(key_budget(MAX_CONTEXT, retention)))
    decode_select(case.v, case.tables, case.positions, case.off2, case.page_size, retention, dense=case.dense,
                  lse=lse, scores=scores, slots=case.slots, state=state, max_context=MAX_CONTEXT,
                  blocks=Blocks(split_select=32, gather=16, select_splits=splits, radix_bits=radix_bits))
    _state_from_scores(state, case, scores, lse, retention)


def test_split_select_twice_finishes_each_call_from_its_own_partials():
    """Two calls in a row on other scores, with the same state and shapes (the second call's
    buffers may reuse the first's memory): each (row, head) is finished by its last gather
    program, from this call's partials (a finish before every partial was stored would miss
    sums, or take the last call's)."""
    case = _case(49, PADDED)
    state = _fill(case.state(key_budget(MAX_CONTEXT, 0.4)))
    for seed in (50, 51):
        scores, lse = _tied_scores(seed, case)
        decode_select(case.v, case.tables, case.positions, case.off2, case.page_size, 0.4, dense=case.dense,
                      lse=lse, scores=scores, slots=case.slots, state=state, max_context=MAX_CONTEXT,
                      blocks=Blocks(split_select=32, gather=16, select_splits=4))
        _state_from_scores(state, case, scores, lse, 0.4)


@pytest.mark.parametrize("dtype, blocks", [(torch.float32, Blocks()),
                                           (torch.bfloat16, dataclasses.replace(SMALL, select=32))])
def test_ties_go_to_the_lower_position(dtype, blocks):
    """With 32-key select blocks (the smallest allowed) row 0's ties run over two blocks,
    the last kept one in the first, and its top key comes after them all."""
    case = _tie_case(dtype)
    want_keys = [[5, 12, 20, 24, 45], [0, 10]]
    assert not _well_separated(case, 0.1)  # the random cases' gap guard rejects ties
    for name, fn in (("reference", source_reference), ("triton", source_triton)):
        state = case.state(5)
        kw = dict(max_context=48, blocks=blocks) if fn is source_triton else {}
        fn(*case.source_args(), 0.1, dense=case.dense, slots=case.slots, state=state, **kw)
        for i, keys in enumerate(want_keys):
            assert _kept(state, int(case.slots[i])).tolist() == [keys] * case.q2.shape[1], name


@pytest.mark.parametrize("use_triton", [False, True])
def test_full_retention_is_dense_attention(use_triton):
    """key_retention 1.0 keeps every key: O_ref - C_ref vanishes and the correction is dense
    attention at depth 3."""
    dtype = torch.float32 if use_triton else torch.float64
    case = _case(3, PADDED, dtype=dtype)
    state = case.state(MAX_CONTEXT, dtype)
    decode_source(*case.source_args(), 1.0, dense=case.dense, slots=case.slots, state=state,
                  max_context=MAX_CONTEXT, use_triton=use_triton)
    out = torch.zeros_like(case.q3)
    decode_correction(*case.correction_args(), slots=case.slots, state=state, out=out, use_triton=use_triton)
    tol = STATE_TOL[dtype] if use_triton else REFERENCE_TOL
    for i, pos in enumerate(PADDED):
        if pos < 0:
            continue
        slot = int(case.slots[i])
        assert int(state.count[slot]) == pos + 1
        assert (_kept(state, slot) == torch.arange(pos + 1, device=DEVICE, dtype=torch.int32)).all()
        _close(state.mass[slot], torch.ones_like(state.mass[slot]), tol)
        _, _, _, dense3 = _flashloop_row(case, i, 1.0)
        _close(out[i], dense3.to(dtype), tol)


# --- budgets, padding, chunks, capacity, dispatch -------------------------------------

@pytest.mark.parametrize("retention", [0.1, 0.07, 0.25, 1 / 3, 0.3, 1.0])
def test_budgets_equal_decode_budget(retention):
    ns = [0, 1, 2, 9, 10, 11, 29, 30, 31, 99, 100, 101, 1000, 4099]
    want = [decode_budget(n, retention) for n in ns]
    assert [key_budget(n, retention) for n in ns] == want
    num, den = Fraction(repr(retention)).as_integer_ratio()
    fits = [n for n in ns if n * num + den - 1 < 1 << 63]  # the device budget is int64
    assert len(fits) >= 10
    assert key_budgets(torch.tensor(fits, device=DEVICE) - 1, retention).tolist() == want[: len(fits)]
    if len(fits) < len(ns):
        with pytest.raises(ValueError, match="too long a decimal"):
            check_capacity(ns[-1], retention, ns[-1])
    else:
        check_capacity(ns[-1], retention, decode_budget(ns[-1], retention))


def test_budgets_are_exact_at_integer_products():
    assert key_budget(30, 0.1) == 3  # the float product 0.1 * 30 is 3.0000000000000004
    assert key_budget(100, 0.07) == 7  # and 0.07 * 100 is 7.000000000000001
    assert (key_budget(1, 0.1), key_budget(10, 0.1), key_budget(11, 0.1)) == (1, 1, 2)
    assert key_budgets(torch.tensor([-1, -5, 0, 29], device=DEVICE), 0.1).tolist() == [0, 0, 1, 3]


@pytest.mark.parametrize("retention", [0.1, 1 / 3])
def test_kernel_counts_at_small_and_exact_budgets(retention):
    """n = 1, 2, 10, 11, 30: the kernel's counts (the in-kernel budget, with a long decimal
    too) and kept keys that are distinct, ascending and causal."""
    positions = [0, 1, 9, 10, 29]
    case = _case(4, positions)
    state = _fill(case.state(key_budget(30, retention)))
    source_triton(*case.source_args(), retention, dense=case.dense, slots=case.slots, state=state, max_context=30)
    for i, pos in enumerate(positions):
        slot = int(case.slots[i])
        assert int(state.count[slot]) == decode_budget(pos + 1, retention)
        kept = _kept(state, slot)
        assert (kept[:, 1:] > kept[:, :-1]).all() and (kept >= 0).all() and (kept <= pos).all()
    slot = int(case.slots[0])  # n = 1: the current token itself, all its mass
    assert (_kept(state, slot) == 0).all()
    _close(state.mass[slot], torch.ones_like(state.mass[slot]), 1e-6)


@pytest.mark.parametrize("use_triton", [False, True])
def test_padding_rows_write_nothing(use_triton):
    """A padding row (slot PAD_SLOT) writes no slot and no output row; the other slots of the
    state and the output rows of rows not corrected stay bit-identical."""
    case = _case(8, [37, -1, 120, -1])
    state = _fill(case.state(20))
    before = _clone(state)
    decode_source(*case.source_args(), 0.1, dense=case.dense, slots=case.slots, state=state, max_context=128,
                  use_triton=use_triton)
    written = {int(case.slots[0]), int(case.slots[2])}
    for slot in range(case.num_slots):
        for name in SLOT_FIELDS:
            same = torch.equal(getattr(state, name)[slot], getattr(before, name)[slot])
            assert same == (slot not in written), (slot, name)
    sentinel = torch.full_like(case.q3, 7.0)
    out = sentinel.clone()
    decode_correction(*case.correction_args(), slots=case.slots, state=state, out=out, use_triton=use_triton)
    assert torch.equal(out[1], sentinel[1]) and torch.equal(out[3], sentinel[3])
    assert not torch.equal(out[0], sentinel[0]) and not torch.equal(out[2], sentinel[2])


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_slot_with_count_0_is_not_corrected(use_triton):
    case = _case(11, [37, 120, 64])
    state = case.state(20)
    decode_source(*case.source_args(), 0.1, dense=case.dense, slots=case.slots, state=state, max_context=128,
                  use_triton=use_triton)
    state.count[case.slots[1]] = 0
    sentinel = torch.full_like(case.q3, 7.0)
    out = sentinel.clone()
    decode_correction(*case.correction_args(), slots=case.slots, state=state, out=out, use_triton=use_triton)
    assert torch.equal(out[1], sentinel[1])
    want = torch.zeros_like(out)
    correction_reference(*case.correction_args(), slots=case.slots, state=state, out=want)
    _close(out[[0, 2]], want[[0, 2]], 1e-5)


def test_chunks_of_a_small_scratch_give_the_same_state():
    """A 3-row scratch (chunks of 3, 3 and 2 rows) gives, bit for bit, the state of one
    scratch holding every row; a wider 1-row one the same kept keys and counts, and m and
    C_ref within 1e-6 (on the H200 a row stride of another alignment changes the reduction
    order of the select kernel's sums: 1 ulp seen)."""
    case = _case(12, PADDED)
    states = []
    for scratch in (torch.empty(len(PADDED), 4, MAX_CONTEXT), torch.empty(3, 4, MAX_CONTEXT),
                    torch.empty(1, 4, MAX_CONTEXT + 40)):
        state = _fill(case.state(key_budget(MAX_CONTEXT, 0.1)))
        source_triton(*case.source_args(), 0.1, dense=case.dense, slots=case.slots, state=state,
                      max_context=MAX_CONTEXT, scratch=scratch.to(DEVICE))
        states.append(state)
    for name in SLOT_FIELDS:
        assert torch.equal(getattr(states[1], name), getattr(states[0], name)), name
        if name in ("mass", "c_ref"):
            torch.testing.assert_close(getattr(states[2], name), getattr(states[0], name), atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(getattr(states[2], name), getattr(states[0], name)), name
    assert scratch_keys(MAX_CONTEXT) == 208 and scratch_keys(208) == 208 and scratch_keys(1) == 16
    row_bytes = 4 * scratch_keys(MAX_CONTEXT) * 4  # rows of whole 16-key blocks
    assert scratch_rows(4, MAX_CONTEXT, 3 * row_bytes + 5) == 3 and scratch_rows(4, MAX_CONTEXT, 0) == 1


def test_capacity_below_a_budget_is_an_error():
    case = _case(9, [99, 10])  # b = 10 and 2
    kw = dict(dense=case.dense, slots=case.slots)
    with pytest.raises(ValueError, match="capacity 9 is below row 0's key budget 10"):
        source_reference(*case.source_args(), 0.1, state=case.state(9), **kw)
    with pytest.raises(ValueError, match="past max_context"):
        source_reference(*case.source_args(), 0.1, state=case.state(10), max_context=99, **kw)
    for use_triton in (False, True):  # checked on the host from max_context alone
        with pytest.raises(ValueError, match="capacity 11 is below the key budget 12"):
            decode_source(*case.source_args(), 0.1, state=case.state(11), max_context=112, use_triton=use_triton,
                          **kw)
    with pytest.raises(ValueError, match="capacity"):
        source_triton(*case.source_args(), 0.1, state=case.state(9), max_context=100, **kw)


def test_dispatch():
    """CUDA or the interpreter: Triton for the kernels' dtypes, the reference for fp64."""
    case = _case(10, [40, 7])
    assert _use_triton(case.q2, None) and not _use_triton(case.q2.double(), None)
    kw = dict(dense=case.dense, slots=case.slots, max_context=48)
    got, triton_state, reference_state = case.state(12), case.state(12), case.state(12)
    decode_source(*case.source_args(), 0.25, state=got, **kw)
    source_triton(*case.source_args(), 0.25, state=triton_state, **kw)
    source_reference(*case.source_args(), 0.25, state=reference_state, **kw)
    assert torch.equal(got.c_ref, triton_state.c_ref)
    assert not torch.equal(got.c_ref, reference_state.c_ref)  # fp32 sums differ
    out, triton_out = torch.zeros_like(case.q3), torch.zeros_like(case.q3)
    decode_correction(*case.correction_args(), slots=case.slots, state=got, out=out)
    correction_triton(*case.correction_args(), slots=case.slots, state=got, out=triton_out)
    assert torch.equal(out, triton_out)
    wide = _case(10, [40, 7], dtype=torch.float64)
    state = wide.state(12, torch.float64)
    decode_source(*wide.source_args(), 0.25, dense=wide.dense, slots=wide.slots, state=state, max_context=48)
    assert state.c_ref.dtype == torch.float64 and int(state.count[wide.slots[0]]) == 11
