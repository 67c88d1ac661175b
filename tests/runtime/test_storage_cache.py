"""The host block cache behind freeing and refilling gathered parameters and packed gradients."""
import pytest
import torch

from fsdp_ext import ops
from fsdp_ext.runtime.core import storage_cache

from ..helpers.dist import run_distributed
from ..helpers.parity import cases_for, run_case

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="needs the compiled extension")

BIG = storage_cache.MIN_BYTES // 4  # fp32 elements of the smallest cached block


@pytest.fixture(autouse=True)
def empty_cache():
    storage_cache.empty_cache()
    yield
    storage_cache.empty_cache()


def test_release_then_fill_reuses_the_block_and_keeps_views():
    full = torch.arange(BIG, dtype=torch.float32)
    view = full[10:20]
    block = full.data_ptr()
    storage_cache.release(full)
    assert full.untyped_storage().nbytes() == 0
    assert storage_cache.cached_bytes() == BIG * 4
    storage_cache.fill(full)
    assert full.untyped_storage().nbytes() == BIG * 4 and full.data_ptr() == block
    assert storage_cache.cached_bytes() == 0
    full.fill_(2.0)
    assert torch.equal(view, torch.full((10,), 2.0))  # the view sees the refilled storage


def test_at_most_two_blocks_of_a_size_are_kept():
    for t in [torch.empty(BIG) for _ in range(3)]:
        storage_cache.release(t)
    assert storage_cache.cached_bytes() == 2 * BIG * 4
    storage_cache.empty_cache()
    assert storage_cache.cached_bytes() == 0


def test_the_cache_holds_at_most_two_of_the_largest_block():
    # Units of many different sizes: the oldest blocks go first, so the idle total stays at most
    # twice the largest block instead of one block per unit.
    sizes = [BIG + 1000 * k for k in range(6)]
    for numel in sizes:
        storage_cache.release(torch.empty(numel))
    assert storage_cache.cached_bytes() == (sizes[-2] + sizes[-1]) * 4
    newest = torch.empty(sizes[-1])
    block = newest.data_ptr()
    storage_cache.release(newest)  # a second block of the largest size pushes out the older one
    assert storage_cache.cached_bytes() == 2 * sizes[-1] * 4
    refill = torch.empty(sizes[-1])
    storage_cache.release(refill)  # a third of that size is not kept
    storage_cache.fill(refill)
    assert refill.data_ptr() == block  # the newest kept block of the size is handed out first


def test_small_buffers_bypass_the_cache():
    small = torch.empty(16)
    storage_cache.release(small)
    assert small.untyped_storage().nbytes() == 0 and storage_cache.cached_bytes() == 0
    storage_cache.fill(small)
    assert small.untyped_storage().nbytes() == 64
    assert storage_cache.empty(16, torch.float32, torch.device("cpu")).shape == (16,)


def test_empty_takes_a_cached_block_and_recycle_returns_it():
    numel = 2 * BIG  # bf16: the same bytes as BIG fp32 elements
    freed = torch.empty(numel, dtype=torch.bfloat16)
    block = freed.data_ptr()
    storage_cache.release(freed)
    flat = storage_cache.empty(numel, torch.bfloat16, torch.device("cpu"))
    assert flat.dtype == torch.bfloat16 and flat.shape == (numel,) and flat.is_contiguous()
    assert flat.data_ptr() == block and storage_cache.cached_bytes() == 0
    storage_cache.recycle(flat)
    assert flat.untyped_storage().nbytes() == 0 and storage_cache.cached_bytes() == numel * 2


def test_filling_a_storage_that_holds_data_is_refused():
    from fsdp_ext import _C
    with pytest.raises(RuntimeError, match="already holds"):
        _C.fill_storage(torch.empty(BIG), BIG * 4)
    with pytest.raises(RuntimeError, match="must be a CPU tensor"):
        _C.release_storage(torch.empty(BIG, device="meta"))


def _parity_through_the_cache(rank: int, world_size: int) -> None:
    # Every CPU buffer goes through the cache here (the parity models are far below 1 MiB).
    storage_cache.MIN_BYTES = 0
    for case in cases_for(world_size):
        run_case(case, rank, world_size)
    assert storage_cache.cached_bytes() > 0, "the runtime did not use the cache"


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_parity_with_every_buffer_cached(world_size):
    run_distributed(_parity_through_the_cache, world_size)


def test_switched_off_everything_goes_to_the_system_allocator(monkeypatch):
    monkeypatch.setattr(storage_cache, "ENABLED", False)  # what FSDP_EXT_STORAGE_CACHE=0 sets
    full = torch.empty(BIG)
    storage_cache.release(full)
    assert full.untyped_storage().nbytes() == 0 and storage_cache.cached_bytes() == 0
    storage_cache.fill(full)
    assert full.untyped_storage().nbytes() == BIG * 4
    flat = storage_cache.empty(BIG, torch.float32, torch.device("cpu"))
    storage_cache.recycle(flat)
    assert flat.untyped_storage().nbytes() == BIG * 4 and storage_cache.cached_bytes() == 0
