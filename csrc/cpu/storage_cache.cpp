// Refilling a freed storage from a cache of blocks instead of the system allocator.
//
// The runtime frees a unit's gathered buffer by shrinking its storage to zero bytes and refills the
// same storage before the next use, so that every view of it (and every tensor autograd saved)
// stays valid. On CPU each refill of a block above glibc's mmap threshold (32 MiB at most) maps
// fresh pages: the kernel zeroes and faults in every page again, for every unit, twice per step
// (about 600k page faults per step and rank for the 201.6M-parameter benchmark model). Here a
// freed block is kept (see kKeepPerSize for how many) and handed to the next storage of its
// (allocator, size). CUDA storages never come here: the CUDA caching allocator already does this.
#include "../storage_cache.h"

#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <mutex>
#include <utility>
#include <vector>

namespace fsdp_ext {
namespace {

// Enough for the steady state of one prefetch depth: a unit's buffer is freed just before the next
// one of the same size is needed (forward: reshard, then prefetch; backward: reshard and the
// finished reduction, then the packed gradients and the prefetch). The cache as a whole holds at
// most kKeepPerSize blocks of the largest size it has seen, dropping the oldest first, so a model
// whose units all differ in size keeps a couple of idle blocks, not one per unit.
constexpr size_t kKeepPerSize = 2;

struct Block {
  c10::Allocator* allocator;
  size_t nbytes;
  c10::DataPtr data;
};

struct Cache {
  std::mutex mutex;
  std::deque<Block> blocks;  // oldest first
  size_t bytes = 0;
  size_t largest = 0;
};

Cache& cache() {
  static auto* instance = new Cache();  // never destroyed: blocks may be released at exit
  return *instance;
}

c10::StorageImpl* host_storage(const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.device().is_cpu(), "storage cache: ", what, " must be a CPU tensor, got ",
              tensor.device());
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->allocator() != nullptr, "storage cache: ", what,
              " has a storage without an allocator (not allocated by torch)");
  return storage;
}

c10::DataPtr take_block(c10::Allocator* allocator, size_t nbytes) {
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    for (auto it = c.blocks.rbegin(); it != c.blocks.rend(); ++it) {  // the newest first
      if (it->allocator == allocator && it->nbytes == nbytes) {
        c10::DataPtr block = std::move(it->data);
        c.blocks.erase(std::next(it).base());
        c.bytes -= nbytes;
        return block;
      }
    }
  }
  return allocator->allocate(nbytes);
}

// Keeps the block if there is room for it; otherwise it is freed when the caller's copy goes.
void give_block(c10::Allocator* allocator, size_t nbytes, c10::DataPtr block) {
  if (block.get() == nullptr || nbytes == 0) return;
  std::vector<Block> dropped;  // freed after the lock is released
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    const auto same = std::count_if(c.blocks.begin(), c.blocks.end(), [&](const Block& b) {
      return b.allocator == allocator && b.nbytes == nbytes;
    });
    if (static_cast<size_t>(same) >= kKeepPerSize) return;
    c.blocks.push_back(Block{allocator, nbytes, std::move(block)});
    c.bytes += nbytes;
    c.largest = std::max(c.largest, nbytes);
    while (c.bytes > kKeepPerSize * c.largest) {
      c.bytes -= c.blocks.front().nbytes;
      dropped.push_back(std::move(c.blocks.front()));
      c.blocks.pop_front();
    }
  }
}

// Gives `tensor`'s storage (which must hold zero bytes) `nbytes` bytes, from the cache if it has a
// block of that size. The contents are undefined, as after resize_.
void fill_storage(const at::Tensor& tensor, int64_t nbytes) {
  c10::StorageImpl* storage = host_storage(tensor, "the tensor to fill");
  TORCH_CHECK(storage->nbytes() == 0, "storage cache: the storage to fill already holds ",
              storage->nbytes(), " bytes");
  TORCH_CHECK(nbytes >= 0, "storage cache: negative size ", nbytes);
  c10::DataPtr block = take_block(storage->allocator(), static_cast<size_t>(nbytes));
  storage->set_data_ptr_noswap(std::move(block));
  storage->set_nbytes(static_cast<size_t>(nbytes));
}

// Takes `tensor`'s storage down to zero bytes, like untyped_storage().resize_(0), keeping the
// block for the next fill of that size. Every tensor on the storage then holds no data.
void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = host_storage(tensor, "the tensor to release");
  const size_t nbytes = storage->nbytes();
  c10::DataPtr block = storage->set_data_ptr(c10::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
  give_block(storage->allocator(), nbytes, std::move(block));
}

// A new CPU tensor of `numel` elements whose block comes from the cache when it has one of that size.
at::Tensor cached_empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "storage cache: negative element count ", numel);
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, take_block(allocator, nbytes),
                       allocator, /*resizable=*/true);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

size_t cached_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.bytes;
}

void empty_cache() {
  std::deque<Block> dropped;
  {
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    dropped.swap(c.blocks);
    c.bytes = 0;
  }  // the blocks are freed here, outside the lock
}

}  // namespace

void register_storage_cache(pybind11::module_& module) {
  module.def("fill_storage", &fill_storage, pybind11::arg("tensor"), pybind11::arg("nbytes"));
  module.def("release_storage", &release_storage, pybind11::arg("tensor"));
  module.def("cached_empty", &cached_empty, pybind11::arg("numel"), pybind11::arg("dtype"));
  module.def("cached_bytes", &cached_bytes);
  module.def("empty_cache", &empty_cache);
}

}  // namespace fsdp_ext
