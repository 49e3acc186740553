// A few rows times a bf16 table, read once: the XLA:CPU custom call behind head_gemv.py.
//
//   out[b, v] = sum_d x[b, d] * table[v, d]     x [B, D] bf16, table [V, D] bf16, out [B, V] f32
//
// One pass over the table, row by row, with up to kMaxRows rows of x at a time (more rows take
// one pass per kMaxRows): every chunk of a table row is loaded once and multiplied into one
// accumulator register per x row; each accumulator's lanes are summed at the row's end. Two
// accumulators per x row (even and odd chunks) so consecutive multiply-adds do not wait on
// each other. The products of two bf16 are exact in f32; the sums are f32, as in XLA:CPU's
// bf16 dot, in another order. Three builds of the same loop, by what -march=native offers:
//   AVX512-BF16  vdpbf16ps: 32 bf16 products a register, summed in pairs into 16 f32 lanes
//                (denormal inputs and results flushed to zero, as the instruction does);
//   AVX-512F     16 bf16 widened to f32 (a bf16 is the high half of an f32), then FMA;
//   otherwise    plain loops over 16 lanes, for the compiler to vectorize.
// Single-threaded: XLA:CPU runs each device's program on its own thread, so a mesh of T host
// devices reads its T table shards on T cores at once.
//
// Cost per pass: V * D * 2 bytes read (the table; x stays in L1), B * V * 4 written,
// 2 * B * V * D FLOPs. At Gemma 3's head (D = 640) and B <= 4 the table dominates: the kernel
// runs at about the rate one core reads memory, where XLA:CPU's dot ran at half of it (it
// repacks the table on every call).

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;

inline float Bf16ToF32(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// The elements [from, d) of one table row times one x row, in plain f32.
inline float Tail(const uint16_t* t, const uint16_t* x, int64_t from, int64_t d) {
  float sum = 0.0f;
  for (int64_t k = from; k < d; ++k) sum += Bf16ToF32(t[k]) * Bf16ToF32(x[k]);
  return sum;
}

#if defined(__AVX512BF16__)
constexpr int64_t kChunk = 32;  // bf16 a register

inline __m512bh LoadPairs(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// kRows rows of x times every table row, into out (row stride v).
template <int64_t kRows>
void Pass(const uint16_t* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  const int64_t full = d - d % (2 * kChunk);
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    __m512 even[kRows], odd[kRows];
    for (int64_t b = 0; b < kRows; ++b) even[b] = odd[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 2 * kChunk) {
      const __m512bh w0 = LoadPairs(t + k), w1 = LoadPairs(t + k + kChunk);
      for (int64_t b = 0; b < kRows; ++b) {
        even[b] = _mm512_dpbf16_ps(even[b], w0, LoadPairs(x + b * d + k));
        odd[b] = _mm512_dpbf16_ps(odd[b], w1, LoadPairs(x + b * d + k + kChunk));
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[b], odd[b]));
      out[b * v + row] = sum + Tail(t, x + b * d, full, d);
    }
  }
}
#elif defined(__AVX512F__)
constexpr int64_t kChunk = 16;  // f32 a register

// 16 bf16 -> 16 f32 (zero-extend each to 32 bits, then shift it into the high half).
inline __m512 Widen(const uint16_t* p) {
  __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

template <int64_t kRows>
void Pass(const uint16_t* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  const int64_t full = d - d % (2 * kChunk);
  std::vector<float> xf(kRows * d);  // x widened once
  for (int64_t i = 0; i < kRows * d; ++i) xf[i] = Bf16ToF32(x[i]);
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    __m512 even[kRows], odd[kRows];
    for (int64_t b = 0; b < kRows; ++b) even[b] = odd[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 2 * kChunk) {
      const __m512 w0 = Widen(t + k), w1 = Widen(t + k + kChunk);
      for (int64_t b = 0; b < kRows; ++b) {
        even[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(&xf[b * d + k]), even[b]);
        odd[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(&xf[b * d + k + kChunk]), odd[b]);
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[b], odd[b]));
      out[b * v + row] = sum + Tail(t, x + b * d, full, d);
    }
  }
}
#else
constexpr int64_t kChunk = 16;  // lanes

template <int64_t kRows>
void Pass(const uint16_t* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  const int64_t full = d - d % kChunk;
  std::vector<float> xf(kRows * d);  // x widened once
  for (int64_t i = 0; i < kRows * d; ++i) xf[i] = Bf16ToF32(x[i]);
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    float acc[kRows][kChunk] = {};
    for (int64_t k = 0; k < full; k += kChunk) {
      float w[kChunk];
      for (int64_t l = 0; l < kChunk; ++l) w[l] = Bf16ToF32(t[k + l]);
      for (int64_t b = 0; b < kRows; ++b) {
        for (int64_t l = 0; l < kChunk; ++l) acc[b][l] += w[l] * xf[b * d + k + l];
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      float sum = 0.0f;
      for (int64_t l = 0; l < kChunk; ++l) sum += acc[b][l];
      out[b * v + row] = sum + Tail(t, x + b * d, full, d);
    }
  }
}
#endif

using PassFn = void (*)(const uint16_t*, const uint16_t*, float*, int64_t, int64_t);
constexpr PassFn kPasses[kMaxRows + 1] = {nullptr,  Pass<1>, Pass<2>, Pass<3>, Pass<4>,
                                          Pass<5>, Pass<6>, Pass<7>, Pass<8>};

ffi::Error HeadGemv(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> table,
                    ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto t_dims = table.dimensions();
  if (x_dims.size() != 2 || t_dims.size() != 2 || x_dims[1] != t_dims[1]) {
    return ffi::Error::InvalidArgument("head_gemv: want x [B, D] and table [V, D]");
  }
  const int64_t rows = x_dims[0], d = x_dims[1], v = t_dims[0];
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* ts = reinterpret_cast<const uint16_t*>(table.typed_data());
  float* os = out->typed_data();
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t n = rows - first < kMaxRows ? rows - first : kMaxRows;
    kPasses[n](xs + first * d, ts, os + first * v, v, d);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxHeadGemv, HeadGemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
