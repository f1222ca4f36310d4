"""The daemon's own copy (copier.py): rows copied exactly as NIXL would pair descriptors
(dst[i] <- src[i]), inline or on threads, merged or cut; rows outside the mappings refused
before a byte moves."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd import copier as copier_module
from kvxferd.copier import INLINE_BYTES, Copier, CopyRead, cut, merge_runs, outside, spans
from kvxferd.nixl_driver import TransferError

PAGE = 4096


def _rows(base: int, pages: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.stack([base + pages * PAGE, lengths, np.zeros_like(pages)], 1).astype(np.int64)


async def _finish(read: CopyRead) -> None:
    while not read.ended():
        await asyncio.sleep(0.001)


def _copy(threads: int, src: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray, src_rows: np.ndarray) -> None:
    copier = Copier(threads)
    woken = []

    async def go() -> None:
        read = copier.post(dst_rows, spans([(dst.ctypes.data, dst.nbytes)]), src_rows,
                           spans([(src.ctypes.data, src.nbytes)]), lambda: woken.append(1))
        await _finish(read)
        assert read.release_if_ended() and read.ended_at() > 0
    try:
        asyncio.run(go())
    finally:
        copier.close()


@settings(max_examples=60, deadline=None)
@given(pages=st.integers(1, 96), seed=st.integers(0, 2**32 - 1), threads=st.integers(1, 3),
       adjacent=st.booleans(), partial=st.booleans())
def test_rows_arrive_exactly_as_paired(pages, seed, threads, adjacent, partial):
    rng = np.random.default_rng(seed)
    total = 128
    src = rng.integers(0, 256, total * PAGE, dtype=np.uint8)
    dst = np.zeros(total * PAGE, dtype=np.uint8)
    src_pages = np.arange(pages) if adjacent else rng.choice(total, pages, replace=False)
    dst_pages = np.arange(pages) if adjacent else rng.choice(total, pages, replace=False)
    lengths = rng.integers(1, PAGE + 1, pages) if partial else np.full(pages, PAGE)
    _copy(threads, src, dst, _rows(dst.ctypes.data, dst_pages, lengths), _rows(src.ctypes.data, src_pages, lengths))
    want = np.zeros_like(dst)
    for d, s, n in zip(dst_pages, src_pages, lengths):
        want[d * PAGE:d * PAGE + n] = src[s * PAGE:s * PAGE + n]
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("readv", [True, False], ids=["process_vm_readv", "memmove"])
def test_a_read_past_the_inline_size_is_copied_on_threads_byte_exact(readv, monkeypatch):
    """Both ways a part is copied: the kernel's (process_vm_readv on this process), and memmove a
    run, where a seccomp profile refuses the call."""
    if not readv:
        monkeypatch.setattr(copier_module, "_readv", None)
    pages = 4 * INLINE_BYTES // PAGE
    src = np.random.default_rng(1).integers(0, 256, pages * PAGE, dtype=np.uint8)
    dst = np.zeros_like(src)
    order = np.random.default_rng(2).permutation(pages)
    _copy(2, src, dst, _rows(dst.ctypes.data, np.arange(pages), np.full(pages, PAGE)),
          _rows(src.ctypes.data, order, np.full(pages, PAGE)))
    assert np.array_equal(dst.reshape(pages, PAGE), src.reshape(pages, PAGE)[order])


@pytest.mark.parametrize("side", ["local", "remote"])
def test_rows_outside_the_mappings_are_refused_before_a_byte_moves(side):
    src = np.full(8 * PAGE, 7, dtype=np.uint8)
    dst = np.zeros(8 * PAGE, dtype=np.uint8)
    good, bad = np.arange(3), np.array([0, 1, 8])  # page 8 is one past the end
    dst_rows = _rows(dst.ctypes.data, bad if side == "local" else good, np.full(3, PAGE))
    src_rows = _rows(src.ctypes.data, bad if side == "remote" else good, np.full(3, PAGE))
    copier = Copier(1)
    with pytest.raises(TransferError, match=f"1 {side} rows lie outside"):
        copier.post(dst_rows, spans([(dst.ctypes.data, dst.nbytes)]), src_rows,
                    spans([(src.ctypes.data, src.nbytes)]), lambda: None)
    copier.close()
    assert not dst.any()


def test_the_bounds_check_cannot_be_wrapped_around():
    assert outside(np.array([2**62], np.int64), np.array([2**62], np.int64), spans([(0, 100)])) == 1
    assert outside(np.array([50], np.int64), np.array([-1], np.int64), spans([(0, 100)])) == 1
    assert outside(np.array([50], np.int64), np.array([50], np.int64), spans([(0, 100)])) == 0
    assert outside(np.array([50], np.int64), np.array([1], np.int64), spans([])) == 1  # released: nothing mapped


def test_runs_merge_where_both_sides_go_on_and_long_ones_are_cut():
    d, s, n = merge_runs(np.array([0, 100, 250, 1000]), np.array([5000, 5100, 5250, 9000]),
                         np.array([100, 150, 50, 30]))
    assert (d.tolist(), s.tolist(), n.tolist()) == ([0, 1000], [5000, 9000], [300, 30])
    d, s, n = cut(d, s, n, 120)
    assert (d.tolist(), s.tolist(), n.tolist()) == ([0, 120, 240, 1000], [5000, 5120, 5240, 9000], [120, 120, 60, 30])


def test_a_call_copies_at_most_iov_max_runs_and_call_bytes(monkeypatch):
    """Linux caps one process_vm_readv call's bytes (2 GiB - 4 KiB): batches stay under CALL_BYTES."""
    monkeypatch.setattr(copier_module, "CALL_BYTES", 100)
    assert copier_module._batches(np.array([60, 30, 20, 100, 5])) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert copier_module._batches(np.ones(2500, dtype=np.int64)) == [(0, 100), *((i, i + 100) for i in
                                                                                 range(100, 2500, 100))]


def test_a_copy_whose_read_ended_starts_no_further_batch():
    import threading

    src = np.full(4 * PAGE, 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    stop = threading.Event()
    stop.set()
    with pytest.raises(copier_module.CopyStopped):
        copier_module.copy_runs(np.array([dst.ctypes.data]), np.array([src.ctypes.data]), np.array([4 * PAGE]), stop)
    assert not dst.any()
