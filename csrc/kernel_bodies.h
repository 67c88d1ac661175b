// The CUDA kernels' bodies, written once for the device and the host.
//
// Each body is what one thread of one block does, given (block, thread, threads per block) as
// arguments instead of blockIdx / threadIdx / blockDim. csrc/cuda/flat_param.cu's __global__
// kernels are one-line wrappers that pass those; csrc/cpu/cuda_bodies_on_host.cpp runs the very same
// bodies over the whole grid on the host (every block, every thread, one after another: threads of
// a block never read what another writes, and use no shared memory or barriers), so the CPU tests
// execute the exact code, index math and packet logic included, that the GPU runs.
#pragma once

#include "flat_layout.h"

#include <cstdint>

namespace fsdp_ext {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kElementsPerBlock = 4096;  // 16 elements per thread: enough work per block

FSDP_EXT_HOST_DEVICE int64_t blocks_for(int64_t elements) {
  return (elements + kElementsPerBlock - 1) / kElementsPerBlock;
}

FSDP_EXT_HOST_DEVICE int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// N elements moved as one 8- or 16-byte access.
template <class T, int N>
struct alignas(sizeof(T) * N) Packet {
  T v[N];
};

// Elements from `p` to the next multiple of `boundary_bytes` (0 when `p` is on one).
template <class T>
FSDP_EXT_HOST_DEVICE int64_t elements_to_boundary(const T* p, uint64_t boundary_bytes) {
  const uint64_t address = reinterpret_cast<uint64_t>(p);
  return static_cast<int64_t>((boundary_bytes - address % boundary_bytes) % boundary_bytes /
                              sizeof(T));
}

// The block's threads write dst[0, n) = cast(src[0, n) * scale); this is thread `thread` of
// `threads`. Packets are used when src and dst reach a packet boundary after the same number of
// elements; otherwise everything is scalar.
template <class Src, class Dst>
FSDP_EXT_HOST_DEVICE void block_convert(const typename Src::storage* src,
                                        typename Dst::storage* dst, int64_t n, float scale,
                                        bool scaled, int thread, int threads) {
  using S = typename Src::storage;
  using D = typename Dst::storage;
  constexpr int kVec = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  int64_t head = elements_to_boundary(src, kVec * sizeof(S));
  if (head != elements_to_boundary(dst, kVec * sizeof(D)) || head > n) head = n;
  const int64_t packets = (n - head) / kVec;
  for (int64_t i = thread; i < head; i += threads) {
    dst[i] = convert_element<Src, Dst>(src[i], scale, scaled);
  }
  const auto* src_packets = reinterpret_cast<const Packet<S, kVec>*>(src + head);
  auto* dst_packets = reinterpret_cast<Packet<D, kVec>*>(dst + head);
  for (int64_t p = thread; p < packets; p += threads) {
    const Packet<S, kVec> in = src_packets[p];
    Packet<D, kVec> out;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kVec; ++k) out.v[k] = convert_element<Src, Dst>(in.v[k], scale, scaled);
    dst_packets[p] = out;
  }
  for (int64_t i = head + packets * kVec + thread; i < n; i += threads) {
    dst[i] = convert_element<Src, Dst>(src[i], scale, scaled);
  }
}

// The block's threads write dst[0, n) = +0 (all-zero bits in every dtype), 16 bytes at a time.
template <class Dst>
FSDP_EXT_HOST_DEVICE void block_zero(typename Dst::storage* dst, int64_t n, int thread,
                                     int threads) {
  using D = typename Dst::storage;
  constexpr int kVec = 16 / sizeof(D);
  const int64_t head = min_i64(n, elements_to_boundary(dst, 16));
  const int64_t packets = (n - head) / kVec;
  for (int64_t i = thread; i < head; i += threads) dst[i] = D(0);
  auto* dst_packets = reinterpret_cast<Packet<D, kVec>*>(dst + head);
  const Packet<D, kVec> zeros = {};
  for (int64_t p = thread; p < packets; p += threads) dst_packets[p] = zeros;
  for (int64_t i = head + packets * kVec + thread; i < n; i += threads) dst[i] = D(0);
}

// Block `block` of pack (kPack) or unpack over a run table of num_runs runs, five int64 columns one
// after another (written by fill_run_table in flat_plan.h):
//   first_block | window_begin | length | tensor_address | tensor_dtype
// kPack: tensors -> flat window (zero-fill runs write zeros); otherwise flat window -> tensors.
template <bool kPack>
FSDP_EXT_HOST_DEVICE void flat_runs_block(const int64_t* table, int64_t num_runs, char* flat,
                                          int64_t flat_dtype, float scale, bool scaled,
                                          int64_t block, int thread, int threads) {
  const int64_t* first_block = table;
  const int64_t run = find_segment(first_block, num_runs, block);
  const int64_t window_begin = table[num_runs + run];
  const int64_t length = table[2 * num_runs + run];
  char* tensor = reinterpret_cast<char*>(table[3 * num_runs + run]);
  const int64_t tensor_dtype = table[4 * num_runs + run];

  const int64_t first = (block - first_block[run]) * kElementsPerBlock;
  const int64_t count = min_i64(kElementsPerBlock, length - first);
  char* flat_at = flat + (window_begin + first) * element_size(flat_dtype);
  if (tensor_dtype == kZeroFill) {
    with_element_type(flat_dtype, [&](auto flat_type) {
      using F = decltype(flat_type);
      block_zero<F>(reinterpret_cast<typename F::storage*>(flat_at), count, thread, threads);
    });
    return;
  }
  char* tensor_at = tensor + first * element_size(tensor_dtype);
  char* src = kPack ? tensor_at : flat_at;
  char* dst = kPack ? flat_at : tensor_at;
  with_element_type(kPack ? tensor_dtype : flat_dtype, [&](auto src_type) {
    with_element_type(kPack ? flat_dtype : tensor_dtype, [&](auto dst_type) {
      using S = decltype(src_type);
      using D = decltype(dst_type);
      block_convert<S, D>(reinterpret_cast<const typename S::storage*>(src),
                          reinterpret_cast<typename D::storage*>(dst), count, scale, scaled,
                          thread, threads);
    });
  });
}

// Block `block` of cast_into_slot: dst[0, n) = cast(src[0, n)).
template <class Src, class Dst>
FSDP_EXT_HOST_DEVICE void cast_block(const typename Src::storage* src, typename Dst::storage* dst,
                                     int64_t n, int64_t block, int thread, int threads) {
  const int64_t first = block * kElementsPerBlock;
  block_convert<Src, Dst>(src + first, dst + first, min_i64(kElementsPerBlock, n - first), 1.0f,
                          false, thread, threads);
}

// Block `block` of grad_epilogue: out = cast((out if accumulate else 0) + reduced / divisor)
// (epilogue_element says how the quotient rounds; factor, mode: epilogue_divide(divisor)).
template <class Src, class Dst>
FSDP_EXT_HOST_DEVICE void epilogue_block(const typename Src::storage* reduced,
                                         typename Dst::storage* out, int64_t n, float factor,
                                         int mode, bool accumulate, int64_t block, int thread,
                                         int threads) {
  const int64_t first = block * kElementsPerBlock;
  const int64_t end = min_i64(first + kElementsPerBlock, n);
  for (int64_t i = first + thread; i < end; i += threads) {
    out[i] = epilogue_element<Src, Dst>(reduced[i], out[i], factor, mode, accumulate);
  }
}

}  // namespace fsdp_ext
