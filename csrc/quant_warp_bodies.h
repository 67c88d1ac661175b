// The CUDA quantized kernels' bodies: one warp per quantization block, written for the host and
// the device as kernel_bodies.h's are. Each body is what lane `lane` of `lanes` does for block b;
// csrc/cuda/quantize.cu's kernels call them with the warp's lane and reduce the partial amax with
// __shfl_xor_sync, csrc/cpu/cuda_bodies_on_host.cpp calls them for every lane in turn and merges
// the partial results in a loop (the merge is exact in any order: quant_bodies.h, BlockAmax), so
// the CPU tests run the code, the per-element arithmetic and the vector access logic included,
// that the GPU runs.
//
// Access: the lanes of a warp read 16 bytes of values each, side by side (a warp reads 512
// contiguous bytes per step), and write the matching 4 or 8 code bytes, when the values and the
// codes reach such a boundary after the same number of elements (`quant_head`); before that
// head, after the last whole packet, and where they never line up, one element per lane.
#pragma once

#include "kernel_bodies.h"
#include "quant_bodies.h"

#include <cstdint>

namespace fsdp_ext {

constexpr int kQuantLanes = 32;        // lanes per quantization block: one warp
constexpr int kQuantBlocksPerCta = 8;  // 256 threads per CUDA block

// Values per 16-byte packet of T, and as many code bytes.
template <class T>
constexpr int quant_vec() {
  return static_cast<int>(16 / sizeof(T));
}

// Elements before the first packet of `count` values at `values` whose codes are at `codes`
// (`count` when the two never reach a packet boundary together).
template <class T>
FSDP_EXT_HOST_DEVICE int64_t quant_head(const T* values, const uint8_t* codes, int64_t count) {
  constexpr int kVec = quant_vec<T>();
  const int64_t head = elements_to_boundary(values, 16);
  return head != elements_to_boundary(codes, kVec) || head > count ? count : head;
}

// Calls f(i, packet_start) for each element i of [0, count) this lane owns: elements [0, head)
// and the tail one by one (packet_start false), whole packets from `head` as one call with the
// packet's first index (packet_start true).
template <int kVec, class F>
FSDP_EXT_HOST_DEVICE void for_lane_elements(int64_t count, int64_t head, int lane, int lanes,
                                            F&& f) {
  const int64_t packets = (count - head) / kVec;
  for (int64_t i = lane; i < head; i += lanes) f(i, false);
  for (int64_t p = lane; p < packets; p += lanes) f(head + p * kVec, true);
  for (int64_t i = head + packets * kVec + lane; i < count; i += lanes) f(i, false);
}

// Lane `lane`'s part of block [0, count) of values' amax.
template <class Src>
FSDP_EXT_HOST_DEVICE BlockAmax lane_amax(const typename Src::storage* values, int64_t count,
                                         int64_t head, int lane, int lanes) {
  using S = typename Src::storage;
  constexpr int kVec = quant_vec<S>();
  BlockAmax part = amax_start();
  for_lane_elements<kVec>(count, head, lane, lanes, [&](int64_t i, bool packet) {
    if (!packet) {
      part = amax_add(part, Src::to_float(values[i]));
      return;
    }
    const Packet<S, kVec> in = *reinterpret_cast<const Packet<S, kVec>*>(values + i);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kVec; ++k) part = amax_add(part, Src::to_float(in.v[k]));
  });
  return part;
}

// Lane `lane`'s codes of block [0, count) of values, whose scale is `scale` (block_scale).
template <class Src, bool kFp8>
FSDP_EXT_HOST_DEVICE void lane_codes(const typename Src::storage* values, uint8_t* codes,
                                     int64_t count, int64_t head, float scale, int lane,
                                     int lanes) {
  using S = typename Src::storage;
  constexpr int kVec = quant_vec<S>();
  const bool coded = block_is_coded(scale);
  for_lane_elements<kVec>(count, head, lane, lanes, [&](int64_t i, bool packet) {
    if (!packet) {
      codes[i] = coded ? quantize_code<kFp8>(Src::to_float(values[i]), scale) : uint8_t{0};
      return;
    }
    // One branch for the packet, not a select per element: with the select, ptxas spilled
    // registers in fp16 -> int8 (a 16-byte stack frame on sm_80 and sm_90); `make cuda-check`
    // fails on any spill.
    Packet<uint8_t, kVec> out = {};
    if (coded) {
      const Packet<S, kVec> in = *reinterpret_cast<const Packet<S, kVec>*>(values + i);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int k = 0; k < kVec; ++k) out.v[k] = quantize_code<kFp8>(Src::to_float(in.v[k]), scale);
    }
    *reinterpret_cast<Packet<uint8_t, kVec>*>(codes + i) = out;
  });
}

// Lane `lane`'s values of block b dequantized: out[i] = the code's value (kSum false, one slot),
// or the fp32 sum over `world` slots `stride` bytes apart from 0.0f in slot order (kSum true).
// Packets of codes need every slot's codes on a packet boundary with out: a stride that is a
// multiple of the packet (the runtime's slots are 16-byte multiples).
template <class Dst, bool kFp8, bool kSum>
FSDP_EXT_HOST_DEVICE void lane_dequantize(const uint8_t* wire, typename Dst::storage* out,
                                          int64_t n, const int64_t* starts, int64_t nblocks,
                                          int64_t world, int64_t stride, int64_t b, int lane,
                                          int lanes) {
  using D = typename Dst::storage;
  constexpr int kVec = quant_vec<D>();
  const int64_t first = starts[b];
  const int64_t count = block_end(starts, nblocks, n, b) - first;
  const int64_t slots = kSum ? world : 1;
  int64_t head = quant_head(out + first, wire + first, count);
  if (kSum && stride % kVec != 0) head = count;
  const auto value = [&](int64_t i) {  // element i of the block, as fp32
    float total = 0.0f;
    for (int64_t r = 0; r < slots; ++r) {
      const uint8_t* slot = wire + r * stride;
      const float x = dequantized_code<kFp8>(slot[first + i], load_scale(slot, n, b));
      total = kSum ? add_rn(total, x) : x;
    }
    return total;
  };
  for_lane_elements<kVec>(count, head, lane, lanes, [&](int64_t i, bool packet) {
    if (!packet) {
      out[first + i] = Dst::from_float(value(i));
      return;
    }
    float totals[kVec];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kVec; ++k) totals[k] = 0.0f;
    for (int64_t r = 0; r < slots; ++r) {
      const uint8_t* slot = wire + r * stride;
      const float scale = load_scale(slot, n, b);
      const Packet<uint8_t, kVec> in =
          *reinterpret_cast<const Packet<uint8_t, kVec>*>(slot + first + i);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int k = 0; k < kVec; ++k) {
        const float x = dequantized_code<kFp8>(in.v[k], scale);
        totals[k] = kSum ? add_rn(totals[k], x) : x;
      }
    }
    Packet<D, kVec> result;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int k = 0; k < kVec; ++k) result.v[k] = Dst::from_float(totals[k]);
    *reinterpret_cast<Packet<D, kVec>*>(out + first + i) = result;
  });
}

}  // namespace fsdp_ext
