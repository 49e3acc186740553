// A few rows times an int8 per-block table, read once: the XLA:CPU custom call behind
// block_gemv.py.
//
//   out[b, o] = sum_i x[b, i] * (values[o, i] * scales[o, i / G] - offsets[o, i / G])
//
//   x [B, I] bf16, values [O, I] int8, scales [O, I / G] f32, offsets [O, I / G] f32 or empty
//   (no offsets), out [B, O] f32; G (the group size, I / scales' columns) a multiple of 16.
//
// That is x times the table whose element is scales * values - offsets (models/gguf_blocks.py
// writes a GGUF tensor in this form, exactly). One pass over the table, two table rows at a
// time, with up to kMaxRows rows of x (more rows take one pass per kMaxRows): every 16 int8 of
// a table row are loaded once, widened and dequantized in f32 (value * scale - offset: the
// operations, and so the bits, of gguf.quants' dequantize), and multiplied into one
// accumulator per (table row, x row) pair; each 16 of x is loaded once for both table rows.
// The sums are f32, in lanes of 16, each lane's sum added at the row's end.
//   AVX-512F   16 int8 sign-extended to int32, converted to f32, scaled, then FMA;
//   otherwise  plain loops over 16 lanes, for the compiler to vectorize.
// (A first version summed each group's products before scaling them: it ran compute-bound,
// 56.7 ms against 19.7 for this one at 8 rows of Gemma 3 270M's head per device.)
// Single-threaded: XLA:CPU runs each device's program on its own thread, so a mesh of T host
// devices reads its T table shards on T cores at once.
//
// Cost per pass: O * I * (1 + 4 / G) bytes read (+ 4 O I / G with offsets; x stays in L1),
// B * O * 4 written, 2 * B * O * I + 2 * O * I FLOPs (the dequantization once a pass). Against
// a bf16 table (2 bytes a weight) that is 0.56x the bytes at G = 32, 0.63x at G = 16.

#include <cstdint>
#include <cstring>
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
constexpr int64_t kLanes = 16;

// What one build multiplies with: Acc, a register of kLanes f32. Weights widens 16 int8 and
// dequantizes them (value * scale, minus the offset where kOffsets: the f32 operations
// gguf.quants' dequantize does, so each weight is bit-identical to its dequantized f32), Madd
// adds their products with 16 f32 of x, Sum adds a register's lanes.
#if defined(__AVX512F__)
struct Lanes {
  using Acc = __m512;
  template <bool kOffsets>
  static Acc Weights(const int8_t* p, float scale, float offset) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const Acc w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                                _mm512_set1_ps(scale));
    return kOffsets ? _mm512_sub_ps(w, _mm512_set1_ps(offset)) : w;
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Madd(Acc acc, Acc w, const float* x) {
    return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc);
  }
  static float Sum(Acc a) { return _mm512_reduce_add_ps(a); }
};
#else
struct Lanes {
  struct Acc {
    float lane[kLanes];
  };
  template <bool kOffsets>
  static Acc Weights(const int8_t* p, float scale, float offset) {
    Acc w;
    for (int64_t l = 0; l < kLanes; ++l) {
      w.lane[l] = static_cast<float>(p[l]) * scale;
      if (kOffsets) w.lane[l] -= offset;
    }
    return w;
  }
  static Acc Zero() { return Acc{}; }
  static Acc Madd(Acc acc, const Acc& w, const float* x) {
    for (int64_t l = 0; l < kLanes; ++l) acc.lane[l] += w.lane[l] * x[l];
    return acc;
  }
  static float Sum(const Acc& a) {
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) sum += a.lane[l];
    return sum;
  }
};
#endif

// The table in int8 blocks: values [O, I], scales and offsets [O, I / G] (offsets read only
// where a pass has kOffsets).
struct Table {
  const int8_t* values;
  const float* scales;
  const float* offsets;
  int64_t outputs, inputs, group;
};

// kTableRows table rows from `first` times kRows rows of x [kRows, I] (f32), into out (row
// stride O): each 16 weights dequantized once, each 16 of x loaded once for all table rows.
template <int64_t kRows, int64_t kTableRows, bool kOffsets>
inline void Tile(const float* x, const Table& t, int64_t first, float* out) {
  const int64_t i = t.inputs, g = t.group, groups = i / g;
  Lanes::Acc acc[kTableRows][kRows];
  for (int64_t r = 0; r < kTableRows; ++r) {
    for (int64_t b = 0; b < kRows; ++b) acc[r][b] = Lanes::Zero();
  }
  for (int64_t n = 0; n < groups; ++n) {
    float scale[kTableRows], offset[kTableRows];
    for (int64_t r = 0; r < kTableRows; ++r) {
      scale[r] = t.scales[(first + r) * groups + n];
      offset[r] = kOffsets ? t.offsets[(first + r) * groups + n] : 0.0f;
    }
    for (int64_t k = n * g; k < (n + 1) * g; k += kLanes) {
      Lanes::Acc w[kTableRows];
      for (int64_t r = 0; r < kTableRows; ++r) {
        w[r] = Lanes::Weights<kOffsets>(t.values + (first + r) * i + k, scale[r], offset[r]);
      }
      for (int64_t b = 0; b < kRows; ++b) {
        for (int64_t r = 0; r < kTableRows; ++r) acc[r][b] = Lanes::Madd(acc[r][b], w[r], x + b * i + k);
      }
    }
  }
  for (int64_t r = 0; r < kTableRows; ++r) {
    for (int64_t b = 0; b < kRows; ++b) out[b * t.outputs + first + r] = Lanes::Sum(acc[r][b]);
  }
}

// kRows rows of x times every table row: two table rows at a time, then the odd one.
template <int64_t kRows, bool kOffsets>
void Pass(const float* x, const Table& t, float* out) {
  int64_t row = 0;
  for (; row + 1 < t.outputs; row += 2) Tile<kRows, 2, kOffsets>(x, t, row, out);
  if (row < t.outputs) Tile<kRows, 1, kOffsets>(x, t, row, out);
}

template <bool kOffsets>
void Passes(const float* x, int64_t rows, const Table& t, float* out) {
  using PassFn = void (*)(const float*, const Table&, float*);
  constexpr PassFn kPasses[kMaxRows + 1] = {
      nullptr,           Pass<1, kOffsets>, Pass<2, kOffsets>, Pass<3, kOffsets>,
      Pass<4, kOffsets>, Pass<5, kOffsets>, Pass<6, kOffsets>, Pass<7, kOffsets>,
      Pass<8, kOffsets>};
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t n = rows - first < kMaxRows ? rows - first : kMaxRows;
    kPasses[n](x + first * t.inputs, t, out + first * t.outputs);
  }
}

ffi::Error BlockGemv(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S8> values,
                     ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets,
                     ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto v_dims = values.dimensions();
  auto s_dims = scales.dimensions();
  if (x_dims.size() != 2 || v_dims.size() != 2 || s_dims.size() != 2 || x_dims[1] != v_dims[1] ||
      s_dims[0] != v_dims[0] || s_dims[1] == 0 || v_dims[1] % s_dims[1] != 0) {
    return ffi::Error::InvalidArgument(
        "block_gemv: want x [B, I], values [O, I] and scales [O, I / G]");
  }
  const int64_t rows = x_dims[0], i = x_dims[1], o = v_dims[0], groups = s_dims[1];
  const int64_t g = i / groups;
  if (g % kLanes != 0) {
    return ffi::Error::InvalidArgument("block_gemv: the group size must be a multiple of 16");
  }
  const bool has_offsets = offsets.element_count() != 0;
  if (has_offsets && offsets.element_count() != o * groups) {
    return ffi::Error::InvalidArgument("block_gemv: offsets must be [O, I / G] or empty");
  }
  const auto* raw = reinterpret_cast<const uint16_t*>(x.typed_data());
  std::vector<float> xs(rows * i);
  for (int64_t k = 0; k < rows * i; ++k) xs[k] = Bf16ToF32(raw[k]);
  const Table t{values.typed_data(), scales.typed_data(),
                has_offsets ? offsets.typed_data() : nullptr, o, i, g};
  if (has_offsets) {
    Passes<true>(xs.data(), rows, t, out->typed_data());
  } else {
    Passes<false>(xs.data(), rows, t, out->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxBlockGemv, BlockGemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
