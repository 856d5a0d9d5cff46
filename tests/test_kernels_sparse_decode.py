"""Sparse decode attention (RFC 3.2): the torch references against the FlashLoop reference
pieces, and the Triton kernels against the references, on random paged caches.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). Each case holds a few decode rows at different,
unsorted positions (context 1 to 200 keys), each with its own shuffled page tables for
depth 2 (the source) and depth 3 (the correction) over one pool.

Tolerances (absolute and relative alike):
- references vs `flashloop_reference` (fp64 inputs): selection and counts equal, values
  1e-12 (REFERENCE_TOL);
- Triton vs reference: fp32 inputs 1e-5 for the state (mass, o_ref, c_ref) and the outputs;
  bf16 / fp16 inputs 1e-4 for the state (both sides compute in fp32 from the same rounded
  values) and 2e-2 for the outputs (out, the correction), which are rounded to the dtype
  (STATE_TOL, OUT_TOL). The kernel's `out` equals its o_ref rounded once, exactly;
- selection (keys in rank order) is compared for equality only on inputs where, in every
  row and head, consecutive ranked probabilities among the first b + 1 differ by more than
  1e-5 relative in fp64 (GAP; fp32 P carries about 1e-6 relative error); other draws are
  redrawn. Ties are tested separately with exactly equal scores (dyadic inputs, every
  product and sum exact);
- key_retention 1.0: the correction equals dense attention at depth 3 to 1e-12 (fp64
  reference) and 1e-5 (fp32 kernel).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from specloop.kernels.sparse_decode import (
    DecodeSource, _use_triton, check_capacity, correction_reference, correction_triton, decode_correction,
    decode_source, key_budget, key_budgets, source_reference, source_triton,
)
from specloop.model.flashloop_reference import (
    _causal_probs, _per_head, corrected_attention, decode_budget, decode_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCE_TOL = 1e-12
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
GAP = 1e-5
POSITIONS = [150, 0, 29, 199, 5, 99]  # unsorted; n = 1, a short row, 10% of 30 exact, ...
MAX_CONTEXT = 200


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

    def source_args(self) -> tuple:
        return self.q2, self.k, self.v, self.tables, self.positions, self.off2, self.page_size

    def correction_args(self) -> tuple:
        return self.q3, self.k, self.v, self.tables, self.positions, self.off3, self.page_size


def _case(seed: int, positions: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 32, page_size: int = 16,
          dtype: torch.dtype = torch.float32, pages: int = 48) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n = len(positions)
    k = torch.randn(pages * page_size, kv_heads, dim, generator=gen)
    v = torch.randn(pages * page_size, kv_heads, dim, generator=gen)
    q2, q3 = torch.randn(n, heads, dim, generator=gen), torch.randn(n, heads, dim, generator=gen)
    tables, off2, off3 = [], [], []
    for pos in positions:
        need = max(1, -(-(pos + 1) // page_size))
        for offsets in (off2, off3):
            offsets.append(len(tables))
            tables.extend(torch.randperm(pages, generator=gen)[:need].tolist())
    to = dict(device=DEVICE)
    return Case(q2.to(dtype).to(**to), q3.to(dtype).to(**to), k.to(dtype).to(**to), v.to(dtype).to(**to),
                torch.tensor(tables, dtype=torch.int32, **to), torch.tensor(positions, **to),
                torch.tensor(off2, **to), torch.tensor(off3, **to), page_size)


def _dense(cache: torch.Tensor, case: Case, offset: int, pos: int) -> torch.Tensor:
    """A row's keys 0..pos read through its page table: [pos + 1, Hkv, D]."""
    j = torch.arange(pos + 1, device=cache.device)
    return cache[case.tables[offset + j // case.page_size].long() * case.page_size + j % case.page_size]


def _flashloop_row(case: Case, i: int, retention: float):
    """FlashLoop's loop-2 reference and loop-3 corrected output for row i, plus its loop-2
    probabilities [Hq, n] and dense loop-3 attention (for retention 1)."""
    heads, dim = case.q2.shape[1], case.q2.shape[2]
    pos = int(case.positions[i])
    at = case.positions[i:i + 1]
    k2 = _per_head(_dense(case.k, case, int(case.off2[i]), pos), heads)  # [n, Hq, D]
    v2 = _per_head(_dense(case.v, case, int(case.off2[i]), pos), heads)
    k3 = _per_head(_dense(case.k, case, int(case.off3[i]), pos), heads).transpose(0, 1)  # [Hq, n, D]
    v3 = _per_head(_dense(case.v, case, int(case.off3[i]), pos), heads).transpose(0, 1)
    probs = _causal_probs(case.q2[i:i + 1], at, k2)[:, 0]  # [Hq, n]
    ref = decode_reference(probs, v2.transpose(0, 1).to(probs.dtype), decode_budget(pos + 1, retention))
    index = ref.keys[..., None].expand(-1, -1, dim)
    acc = probs.dtype
    scores = torch.einsum("hd,hbd->hb", case.q3[i].to(acc), k3.gather(1, index).to(acc)) * dim ** -0.5
    corrected = corrected_attention(ref.o_ref, ref.c_ref, ref.mass, scores, v3.gather(1, index).to(acc))
    dense3 = torch.einsum("hn,hnd->hd", _causal_probs(case.q3[i:i + 1], at, k3.transpose(0, 1))[:, 0], v3.to(acc))
    return ref, corrected, probs, dense3


def _well_separated(case: Case, retention: float) -> bool:
    """Every row and head: consecutive ranked probabilities among the first b + 1 differ by
    more than GAP relative (fp64 over the case's rounded inputs)."""
    wide = dataclasses.replace(case, q2=case.q2.double(), q3=case.q3.double(), k=case.k.double(), v=case.v.double())
    for i, pos in enumerate(case.positions.tolist()):
        if pos < 0:
            continue
        _, _, probs, _ = _flashloop_row(wide, i, retention)
        top = probs.sort(-1, descending=True).values[:, : decode_budget(pos + 1, retention) + 1]
        if top.shape[-1] > 1 and ((top[:, :-1] - top[:, 1:]) <= GAP * top[:, :-1]).any():
            return False
    return True


def _separated_case(seed: int, retention: float, **kw) -> Case:
    for attempt in range(20):
        case = _case(seed * 100 + attempt, POSITIONS, **kw)
        if _well_separated(case, retention):
            return case
    raise AssertionError("no well-separated draw in 20 seeds")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.to(want.dtype), want, atol=tol, rtol=tol)


def _source_close(got: DecodeSource, want: DecodeSource, dtype: torch.dtype) -> None:
    assert torch.equal(got.count, want.count)
    assert torch.equal(got.keys, want.keys)
    for name in ("mass", "o_ref", "c_ref"):
        _close(getattr(got, name), getattr(want, name), STATE_TOL[dtype])
    _close(got.out.float(), want.out.float(), OUT_TOL[dtype])


# --- the references against FlashLoop's pieces ----------------------------------------

@pytest.mark.parametrize("retention", [0.1, 0.25, 0.07])
def test_references_equal_flashloop_pieces(retention):
    """fp64: selection, counts and every statistic of each row as decode_reference gives
    them, and the correction as corrected_attention gives it."""
    case = _case(1, POSITIONS, dtype=torch.float64)
    capacity = key_budget(MAX_CONTEXT, retention)
    source = source_reference(*case.source_args(), retention, capacity, max_context=MAX_CONTEXT)
    out = correction_reference(*case.correction_args(), source)
    assert source.mass.dtype == source.o_ref.dtype == torch.float64
    for i, pos in enumerate(POSITIONS):
        ref, corrected, _, _ = _flashloop_row(case, i, retention)
        b = decode_budget(pos + 1, retention)
        assert int(source.count[i]) == b
        assert torch.equal(source.keys[i, :, :b].long(), ref.keys)
        assert (source.keys[i, :, b:] == -1).all()
        for got, want in ((source.mass[i], ref.mass), (source.o_ref[i], ref.o_ref), (source.c_ref[i], ref.c_ref),
                          (out[i], corrected)):
            torch.testing.assert_close(got, want, atol=REFERENCE_TOL, rtol=0)
    assert torch.equal(source.out, source.o_ref)  # fp64: the output is o_ref itself


# --- Triton against the references ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim, block_n", [(4, 2, 32, 32), (4, 4, 16, 16), (6, 2, 24, 32)])
def test_kernels_match_references(dtype, heads, kv_heads, dim, block_n):
    retention = 0.1
    case = _separated_case(heads * 10 + dim, retention, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype)
    capacity = key_budget(MAX_CONTEXT, retention) + 3  # a bucket above every row's budget
    want = source_reference(*case.source_args(), retention, capacity)
    got = source_triton(*case.source_args(), retention, capacity, max_context=MAX_CONTEXT, block_n=block_n)
    _source_close(got, want, dtype)
    assert got.mass.dtype == got.o_ref.dtype == got.c_ref.dtype == torch.float32 and got.out.dtype == dtype
    assert torch.equal(got.out, got.o_ref.to(dtype))  # rounded once, to nearest even
    out = correction_triton(*case.correction_args(), got, block_n=block_n)
    _close(out.float(), correction_reference(*case.correction_args(), want).float(), OUT_TOL[dtype])


def _tie_case(dtype: torch.dtype) -> Case:
    """Dyadic q and K (every product and sum exact in fp32): all heads share one query of
    ones, so every head ranks alike. Row 0 (pos 47, b = 5): key 33 on top, six equal keys
    below it at 5, 12, 20, 31, 38, 44. Row 1 (pos 19, b = 2): equal top keys at 0, 10, 19."""
    case = _case(5, [47, 19], dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    # Disjoint shuffled pages (3 for row 0, 2 for row 1), so neither row sees the other's keys.
    tables = torch.randperm(48, generator=gen)[:5].to(device=DEVICE, dtype=torch.int32)
    offsets = torch.tensor([0, 3], device=DEVICE)
    case = dataclasses.replace(case, tables=tables, off2=offsets, off3=offsets)
    k = (torch.randint(-1, 2, case.k.shape, generator=gen) * 0.25).to(case.k.device)
    q2 = torch.ones_like(case.q2)
    for i, (top, tied) in enumerate([(33, [5, 12, 20, 31, 38, 44]), (None, [0, 10, 19])]):
        rows = _dense(torch.arange(k.shape[0], device=k.device), case, int(case.off2[i]), int(case.positions[i]))
        if top is not None:
            k[rows[top]] = 0.75
        k[rows[tied]] = 0.5
    return dataclasses.replace(case, q2=q2.to(dtype), q3=case.q3.to(dtype), k=k.to(dtype), v=case.v.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_lower_position(dtype):
    case = _tie_case(dtype)
    want_keys = [[33, 5, 12, 20, 31], [0, 10]]
    assert not _well_separated(case, 0.1)  # the random cases' gap guard rejects ties
    for fn, kw in ((source_reference, {}), (source_triton, dict(max_context=48))):
        source = fn(*case.source_args(), 0.1, 5, **kw)
        assert source.count.tolist() == [5, 2]
        for i, keys in enumerate(want_keys):
            assert source.keys[i, :, : len(keys)].tolist() == [keys] * case.q2.shape[1], fn.__name__
            assert (source.keys[i, :, len(keys):] == -1).all()


@pytest.mark.parametrize("use_triton", [False, True])
def test_full_retention_is_dense_attention(use_triton):
    """key_retention 1.0 keeps every key: O_ref - C_ref vanishes and the correction is dense
    attention at depth 3."""
    dtype = torch.float32 if use_triton else torch.float64
    case = _case(3, POSITIONS, dtype=dtype)
    source = decode_source(*case.source_args(), 1.0, MAX_CONTEXT, max_context=MAX_CONTEXT, use_triton=use_triton)
    out = decode_correction(*case.correction_args(), source, use_triton=use_triton)
    tol = STATE_TOL[dtype] if use_triton else REFERENCE_TOL
    for i, pos in enumerate(POSITIONS):
        assert int(source.count[i]) == pos + 1
        _close(source.mass[i], torch.ones_like(source.mass[i]), tol)
        _, _, _, dense3 = _flashloop_row(case, i, 1.0)
        _close(out[i], dense3.to(dtype), tol)


# --- budgets, padding, capacity, dispatch ---------------------------------------------

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


def test_kernel_counts_at_small_and_exact_budgets():
    """n = 1, 2, 10, 11, 30: the kernel's counts and the number of kept keys per head."""
    positions = [0, 1, 9, 10, 29]
    case = _case(4, positions)
    source = source_triton(*case.source_args(), 0.1, 3, max_context=30)
    want = [decode_budget(p + 1, 0.1) for p in positions]
    assert source.count.tolist() == want == [1, 1, 1, 2, 3]
    assert ((source.keys >= 0).sum(-1) == torch.tensor(want, device=DEVICE)[:, None]).all()
    assert (source.keys[0, :, 0] == 0).all()  # n = 1: the current token itself, all its mass
    _close(source.mass[0], torch.ones_like(source.mass[0]), 1e-6)


@pytest.mark.parametrize("use_triton", [False, True])
def test_padding_rows_are_not_written(use_triton):
    positions = [37, -1, 120, -1]
    case = _case(8, positions)
    sentinel = torch.full_like(case.q2, 7.0)
    source = decode_source(*case.source_args(), 0.1, 20, max_context=128, out=sentinel.clone(),
                           use_triton=use_triton)
    for i in (1, 3):
        assert torch.equal(source.out[i], sentinel[i])
        assert int(source.count[i]) == 0 and (source.keys[i] == -1).all()
        assert (source.mass[i] == 0).all() and (source.o_ref[i] == 0).all() and (source.c_ref[i] == 0).all()
    assert not torch.equal(source.out[0], sentinel[0])
    # A row whose count is 0 is skipped by the correction as well.
    source.count[2] = 0
    out = decode_correction(*case.correction_args(), source, out=sentinel.clone(), use_triton=use_triton)
    for i in (1, 2, 3):
        assert torch.equal(out[i], sentinel[i])
    want = correction_reference(*case.correction_args(), source)
    _close(out[0], want[0], 1e-5)


def test_capacity_below_a_budget_is_an_error():
    case = _case(9, [99, 10])  # b = 10 and 2
    with pytest.raises(ValueError, match="capacity 9 is below row 0's key budget 10"):
        source_reference(*case.source_args(), 0.1, 9)
    with pytest.raises(ValueError, match="past max_context"):
        source_reference(*case.source_args(), 0.1, 10, max_context=99)
    for use_triton in (False, True):  # checked on the host from max_context alone
        with pytest.raises(ValueError, match="capacity 11 is below the key budget 12"):
            decode_source(*case.source_args(), 0.1, 11, max_context=112, use_triton=use_triton)
    with pytest.raises(ValueError, match="capacity"):
        source_triton(*case.source_args(), 0.1, 9, max_context=100)
    # A capacity above the context (a large bucket) is fine: the extra entries are -1.
    got = source_triton(*case.source_args(), 0.1, 128, max_context=100)
    want = source_reference(*case.source_args(), 0.1, 128)
    assert got.keys.shape == (2, 4, 128) and torch.equal(got.keys, want.keys)


def test_dispatch():
    """CUDA or the interpreter: Triton for the kernels' dtypes, the reference for fp64."""
    case = _case(10, [40, 7])
    assert _use_triton(case.q2, None) and not _use_triton(case.q2.double(), None)
    got = decode_source(*case.source_args(), 0.25, 12, max_context=48)
    assert torch.equal(got.o_ref, source_triton(*case.source_args(), 0.25, 12, max_context=48).o_ref)
    assert not torch.equal(got.o_ref, source_reference(*case.source_args(), 0.25, 12).o_ref)  # fp32 sums differ
    out = decode_correction(*case.correction_args(), got)
    assert torch.equal(out, correction_triton(*case.correction_args(), got))
    wide = _case(10, [40, 7], dtype=torch.float64)
    ref = decode_source(*wide.source_args(), 0.25, 12, max_context=48)
    assert torch.equal(ref.o_ref, source_reference(*wide.source_args(), 0.25, 12).o_ref)
    assert ref.o_ref.dtype == torch.float64
