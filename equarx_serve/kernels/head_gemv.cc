// A few rows times a bf16 table, read once: the XLA:CPU custom call behind head_gemv.py.
//
//   out[b, v] = sum_d x[b, d] * table[v, d]      x [B, D] f32, table [V, D] bf16, out [B, V] f32
//
// One pass over the table, row by row: each 16 bf16 of a table row are widened to f32 once (a
// bf16 is the high half of an f32) and multiplied into up to kMaxRows accumulators, one per x
// row, 16 lanes each; a row's 16 lanes are summed at its end. Batches of more than kMaxRows
// rows take one pass per kMaxRows. Single-threaded: XLA:CPU runs each device's program on its
// own thread, so a mesh of T host devices reads its T table shards on T cores at once.
//
// Cost per pass: V * D * 2 bytes read (the table; x stays in L1), B * V * 4 written,
// 2 * B * V * D FLOPs. At Gemma 3's head (D = 640) the table dominates: the kernel runs at the
// rate one core reads memory, where XLA:CPU's dot ran at about half of it (it repacks the
// table on every call).

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 8;

inline float Bf16ToF32(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 bf16 -> 16 f32 (zero-extend each to 32 bits, then shift it into the high half).
inline __m512 Load16(const uint16_t* t) {
  __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// kRows (<= kMaxRows) rows of x times every table row, into out (row stride v): two zmm
// accumulators per x row (even and odd chunks of 16, so consecutive FMAs do not wait on each
// other), summed across their lanes at the end of each table row.
template <int64_t kRows>
void Pass(const float* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  const int64_t pairs = d - d % (2 * kLanes);
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    __m512 even[kRows], odd[kRows];
    for (int64_t b = 0; b < kRows; ++b) even[b] = odd[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; k += 2 * kLanes) {
      const __m512 w0 = Load16(t + k), w1 = Load16(t + k + kLanes);
      for (int64_t b = 0; b < kRows; ++b) {
        even[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * d + k), even[b]);
        odd[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * d + k + kLanes), odd[b]);
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[b], odd[b]));
      for (int64_t k = pairs; k < d; ++k) sum += Bf16ToF32(t[k]) * x[b * d + k];
      out[b * v + row] = sum;
    }
  }
}
#else
// kRows (<= kMaxRows) rows of x times every table row, into out (row stride v); 16 lanes of
// accumulators per x row, for the compiler to vectorize.
template <int64_t kRows>
void Pass(const float* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  const int64_t full = d - d % kLanes;
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    float acc[kRows][kLanes] = {};
    for (int64_t k = 0; k < full; k += kLanes) {
      float w[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) w[l] = Bf16ToF32(t[k + l]);
      for (int64_t b = 0; b < kRows; ++b) {
        const float* xb = x + b * d + k;
        for (int64_t l = 0; l < kLanes; ++l) acc[b][l] += w[l] * xb[l];
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += acc[b][l];
      for (int64_t k = full; k < d; ++k) sum += Bf16ToF32(t[k]) * x[b * d + k];
      out[b * v + row] = sum;
    }
  }
}
#endif

using PassFn = void (*)(const float*, const uint16_t*, float*, int64_t, int64_t);
constexpr PassFn kPasses[kMaxRows + 1] = {nullptr,  Pass<1>, Pass<2>, Pass<3>, Pass<4>,
                                          Pass<5>, Pass<6>, Pass<7>, Pass<8>};

ffi::Error HeadGemv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> table,
                    ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto t_dims = table.dimensions();
  if (x_dims.size() != 2 || t_dims.size() != 2 || x_dims[1] != t_dims[1]) {
    return ffi::Error::InvalidArgument("head_gemv: want x [B, D] and table [V, D]");
  }
  const int64_t rows = x_dims[0], d = x_dims[1], v = t_dims[0];
  const float* xs = x.typed_data();
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
