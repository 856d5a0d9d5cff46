"""Host records of INT4 residual groups (`specloop.flashloop.kv_residual.records`): how many
each plane of a request takes, with and without token-sparse prefill, through growth,
rollback and the updates the device learns."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from specloop.flashloop.config import TokenSparsePrefill
from specloop.scheduling.kv_manager import OutOfPages
from specloop.flashloop.kv_residual.records import GROUP, ResidualRecords

PLANES = 4


def _rows_brute(windows: TokenSparsePrefill | None, plane: int, prompt_len: int, n: int) -> int:
    """Rows plane `plane` holds at most in [0, n): walk the prompt's windows one by one."""
    if windows is None or not windows.active:
        return n
    rows, start = 0, 0
    while start < min(n, prompt_len):
        end = min(start + windows.window, prompt_len)
        length = end - start
        keep = windows.budget(plane, length) if windows.sparse(plane, length) else length
        rows += min(min(n, end) - start, keep)
        start = end
    return rows + max(0, n - prompt_len)


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 40), prompt_len=st.integers(0, 300), n=st.integers(0, 400),
       retention=st.sampled_from([(1.0, 1.0, 0.25, 0.10), (1.0, 1.0, 0.5, 0.5), (1.0, 1.0, 1.0, 0.3),
                                  (1.0, 1.0, 1.0, 1.0)]))
def test_row_bound_walks_the_windows(window, prompt_len, n, retention):
    windows = TokenSparsePrefill(enabled=True, window=window, retention=retention)
    records = ResidualRecords(PLANES, 10, 1, windows)
    for plane in range(PLANES):
        assert records.row_bound(plane, prompt_len, n) == _rows_brute(windows, plane, prompt_len, n)


def test_dense_planes_take_a_record_per_64_positions():
    records = ResidualRecords(PLANES, 100, 7)
    assert records.windows is None
    records.add("r", 300)
    assert records.records_for("r", 130) == 3 * PLANES
    records.ensure("r", 130)
    assert [len(t) for t in records.tables("r")] == [3] * PLANES
    assert records.bytes_used("r") == 3 * PLANES * 7
    # switched off or all-dense retention: the same
    off = ResidualRecords(PLANES, 100, 7, TokenSparsePrefill(enabled=False))
    assert off.windows is None
    flat = ResidualRecords(PLANES, 100, 7, TokenSparsePrefill(enabled=True, retention=(1.0, 1.0, 1.0, 1.0)))
    assert flat.windows is None


def test_sparse_planes_take_records_for_their_budgets():
    """Window 512 at 1/1/0.25/0.10: an 8K prompt's planes 2 and 3 hold 128 and 52 rows a
    window, so they take 32 and 13 records where the dense planes take 128; generated
    positions count fully."""
    windows = TokenSparsePrefill(enabled=True)
    records = ResidualRecords(PLANES, 1000, 1, windows)
    assert records.records_for(None, 8192, 8192) == 128 + 128 + 32 + math.ceil(16 * 52 / GROUP)
    records.add("r", 8192)
    records.ensure("r", 8192)
    assert [len(t) for t in records.tables("r")] == [128, 128, 32, 13]
    records.ensure("r", 8192 + 100)  # 100 generated tokens: 2 more records in each plane
    assert [len(t) for t in records.tables("r")] == [130, 130, 34, 15]
    fresh, first, tables, truncate, _ = records.pending("r")
    assert fresh and first == [0] * PLANES and truncate is None
    assert [len(t) for t in tables] == [130, 130, 34, 15]
    records.ensure("r", 8192 + 200)
    fresh, first, tables, truncate, _ = records.pending("r")
    assert not fresh and first == [130, 130, 34, 15] and [len(t) for t in tables] == [2, 2, 2, 2]
    # a rollback to a position in the prompt keeps what its rows below need, per plane
    free = records.num_free
    records.truncate("r", 1000)
    assert [len(t) for t in records.tables("r")] == [16, 16, 4, 2]  # 1000 rows; 512 + 128 kept; 52 + 52
    fresh, first, tables, truncate, _ = records.pending("r")
    assert not fresh and first == [16, 16, 4, 2] and all(not t for t in tables) and truncate == 1000
    assert records.num_free - free == (132 + 132 + 36 + 17) - (16 + 16 + 4 + 2)
    records.free("r")
    assert records.num_free == records.num_records


def test_growth_is_all_or_nothing():
    records = ResidualRecords(PLANES, 10, 1)
    records.add("a", 0)
    records.ensure("a", 64)
    assert records.num_free == 6
    with pytest.raises(OutOfPages):
        records.ensure("a", 192)  # 2 more a plane: 8 of 6
    assert records.num_free == 6 and [len(t) for t in records.tables("a")] == [1] * PLANES
    with pytest.raises(ValueError):
        records.add("a", 0)


def test_a_rollback_keeps_records_for_the_pages_kept_and_frees_the_rest_once_sent():
    """Truncating to 94 with pages kept up to 96: plane 2 (window 16, 1/1/0.5/0.25, prompt
    60) holds 64 rows at 94 but 66 at 96, so it keeps its second record. The records dropped
    stay taken until the update that truncates the device is sent (its tables still name
    them until then)."""
    windows = TokenSparsePrefill(enabled=True, window=16, retention=(1.0, 1.0, 0.5, 0.25))
    records = ResidualRecords(PLANES, 100, 1, windows)
    records.add("r", 60)
    records.ensure("r", 200)
    records.pending("r")
    assert [len(t) for t in records.tables("r")] == [4, 4, 3, 3]
    free = records.num_free
    records.truncate("r", 94, 96)
    assert [len(t) for t in records.tables("r")] == [2, 2, 2, 1]
    assert records.num_free == free and records.held("r") == 14
    fresh, first, tables, truncate, _ = records.pending("r")
    assert truncate == 94 and first == [2, 2, 2, 1] and not any(tables)
    assert records.num_free == free + 7 and records.held("r") == 7
    records.truncate("r", 50)  # dropped records a free() returns too
    records.free("r")
    assert records.num_free == records.num_records


def test_kv_manager_rollback_keeps_records_for_its_pages():
    """KVManager.truncate keeps pages up to the next page boundary, and records for them:
    regrowing within those pages adds no page, so it could add no record."""
    from specloop.scheduling.kv_manager import KVManager
    windows = TokenSparsePrefill(enabled=True, window=16, retention=(1.0, 1.0, 0.5, 0.25))
    kv = KVManager(PLANES, 8, 400, 1)
    kv.records = ResidualRecords(PLANES, 100, 1, windows)
    kv.add_request("r", prompt_len=60)
    kv.ensure("r", 200)
    kv.truncate("r", 94)
    assert kv.coverage("r") == 96
    assert [len(t) for t in kv.records.tables("r")] == [2, 2, 2, 1]  # plane 2: 66 rows may fill [0, 96)
    kv.ensure("r", 96)
    assert [len(t) for t in kv.records.tables("r")] == [2, 2, 2, 1]
