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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using equarx::Bf16ToF32;

constexpr int64_t kMaxRows = 8;

inline float ToF32(uint16_t bf16) { return Bf16ToF32(bf16); }
inline float ToF32(float value) { return value; }

// What one build multiplies with: X, x's element as the loop reads it; W, one chunk of kChunk
// table elements; Acc, an accumulator register. Load widens a chunk of the table, Madd adds a
// chunk's products with x to an accumulator, Sum adds two accumulators' lanes.
#if defined(__AVX512BF16__)
// vdpbf16ps: 32 bf16 products a register, summed in pairs into 16 f32 lanes; x stays bf16.
struct Lanes {
  using X = uint16_t;
  using W = __m512bh;
  using Acc = __m512;
  static constexpr int64_t kChunk = 32;
  static W Load(const uint16_t* p) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Madd(Acc acc, W w, const X* x) { return _mm512_dpbf16_ps(acc, w, Load(x)); }
  static float Sum(Acc a, Acc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
};
#elif defined(__AVX512F__)
// 16 bf16 widened to f32 (zero-extended to 32 bits, shifted into the high half), then FMA.
struct Lanes {
  using X = float;
  using W = __m512;
  using Acc = __m512;
  static constexpr int64_t kChunk = 16;
  static W Load(const uint16_t* p) {
    __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Madd(Acc acc, W w, const X* x) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
  static float Sum(Acc a, Acc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
};
#else
// Plain loops over 16 lanes, for the compiler to vectorize.
struct Lanes {
  static constexpr int64_t kChunk = 16;
  using X = float;
  struct Acc {
    float lane[kChunk];
  };
  using W = Acc;
  static W Load(const uint16_t* p) {
    W w;
    for (int64_t l = 0; l < kChunk; ++l) w.lane[l] = Bf16ToF32(p[l]);
    return w;
  }
  static Acc Zero() { return Acc{}; }
  static Acc Madd(Acc acc, const W& w, const X* x) {
    for (int64_t l = 0; l < kChunk; ++l) acc.lane[l] += w.lane[l] * x[l];
    return acc;
  }
  static float Sum(const Acc& a, const Acc& b) {
    float sum = 0.0f;
    for (int64_t l = 0; l < kChunk; ++l) sum += a.lane[l] + b.lane[l];
    return sum;
  }
};
#endif

// The elements [from, d) of one table row times one x row, in plain f32.
inline float Tail(const uint16_t* t, const Lanes::X* x, int64_t from, int64_t d) {
  float sum = 0.0f;
  for (int64_t k = from; k < d; ++k) sum += Bf16ToF32(t[k]) * ToF32(x[k]);
  return sum;
}

// kRows rows of x times every table row, into out (row stride v): each table chunk loaded once
// for all rows, two accumulators per row (even and odd chunks).
template <int64_t kRows>
void Pass(const Lanes::X* x, const uint16_t* table, float* out, int64_t v, int64_t d) {
  constexpr int64_t kChunk = Lanes::kChunk;
  const int64_t full = d - d % (2 * kChunk);
  for (int64_t row = 0; row < v; ++row) {
    const uint16_t* t = table + row * d;
    Lanes::Acc even[kRows], odd[kRows];
    for (int64_t b = 0; b < kRows; ++b) even[b] = odd[b] = Lanes::Zero();
    for (int64_t k = 0; k < full; k += 2 * kChunk) {
      const Lanes::W w0 = Lanes::Load(t + k), w1 = Lanes::Load(t + k + kChunk);
      for (int64_t b = 0; b < kRows; ++b) {
        even[b] = Lanes::Madd(even[b], w0, x + b * d + k);
        odd[b] = Lanes::Madd(odd[b], w1, x + b * d + k + kChunk);
      }
    }
    for (int64_t b = 0; b < kRows; ++b) {
      out[b * v + row] = Lanes::Sum(even[b], odd[b]) + Tail(t, x + b * d, full, d);
    }
  }
}

// x [n] bf16 as the loop reads it: as stored, or widened once into `widened` for the builds
// that multiply in f32.
template <typename X>
const X* Prepared(const uint16_t* raw, int64_t n, std::vector<float>& widened) {
  if constexpr (std::is_same_v<X, uint16_t>) {
    return raw;
  } else {
    widened.resize(n);
    for (int64_t i = 0; i < n; ++i) widened[i] = Bf16ToF32(raw[i]);
    return widened.data();
  }
}

using PassFn = void (*)(const Lanes::X*, const uint16_t*, float*, int64_t, int64_t);
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
  std::vector<float> widened;
  const Lanes::X* xs = Prepared<Lanes::X>(
      reinterpret_cast<const uint16_t*>(x.typed_data()), rows * d, widened);
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
