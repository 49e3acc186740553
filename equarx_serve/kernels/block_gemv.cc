// A few rows times an int8 per-block table, read once: the XLA:CPU custom call behind
// block_gemv.py.
//
//   out[b, o] = sum_i x[b, i] * (values[o, i] * scales[o, i / G] - offsets[o, i / G])
//
//   x [B, I] bf16, values [O, I] int8, scales [O, I / G] f32, offsets [O, I / G] f32 or empty
//   (no offsets), out [B, O] f32; G (the group size, I / scales' columns) a multiple of 16.
//
// That is x times the table whose element is scales * values - offsets (models/gguf_blocks.py
// writes a GGUF tensor in this form, exactly). One pass over the table, a tile of table rows
// at a time (two, one for more than 4 rows of x), with up to kMaxRows rows of x (more rows take
// one pass per kMaxRows). Per group of G weights of a table row: its 16-int8 runs are widened
// to f32 once (exact integers), multiplied into one group sum per x row (f32 FMAs), and each
// group sum is scaled once, acc += scale * sum, into two accumulators (even and odd groups, so
// consecutive groups do not wait for each other); the offsets' part, sum over groups of
// offset * (the group's sum of x), is taken from the x rows' group sums at the row's end. The
// rows a few tiles ahead are prefetched: without it the pass ran at ~8 GB/s, under a third of
// a core's read bandwidth (docs/decisions.md).
//   AVX-512 VBMI  16 int8, sign bits flipped, placed by one byte permute into the low bytes of
//                 f32 2^23 and 2^23 + 128 subtracted (exact);
//   AVX-512F      16 int8 sign-extended to int32, converted to f32;
//   otherwise     plain loops over 16 lanes, for the compiler to vectorize.
// The sums differ from a per-weight dequantization (value * scale - offset, then x times it) in
// the last bits of the f32 sums; both are tested against the exact (f64) product.
// Single-threaded: XLA:CPU runs each device's program on its own thread, so a mesh of T host
// devices reads its T table shards on T cores at once.
//
// Cost per pass: O * I * (1 + 4 / G) bytes read (+ 4 O I / G with offsets; x stays in L1),
// B * O * 4 written, 2 * B * O * I + O * I FLOPs (+ 2 B O I / G for the scaling). Against a bf16
// table (2 bytes a weight) that is 0.56x the bytes at G = 32, 0.63x at G = 16.

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
constexpr int64_t kPrefetchTiles = 4;  // how far ahead of the tile being read (measured: 2-8 alike)

// What one build multiplies with: Acc, a register of kLanes f32. Widen makes 16 int8 f32
// (exact), Madd adds their products with 16 f32 of x, Scale adds a group sum times its scale,
// Sum adds a register's lanes.
#if defined(__AVX512F__)
struct Lanes {
  using Acc = __m512;
  static Acc Widen(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(__AVX512VBMI__)
    // Byte k (sign bit flipped: k + 128, in [0, 255]) into lane k's low byte of 2^23's bits.
    const __m512i spread = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i bits = _mm512_mask_permutexvar_epi8(
        _mm512_set1_epi32(0x4B000000), 0x1111111111111111ull, spread,
        _mm512_castsi128_si512(_mm_xor_si128(bytes, _mm_set1_epi8(-128))));
    return _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(8388608.0f + 128.0f));
#else
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#endif
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Load(const float* x) { return _mm512_loadu_ps(x); }
  static Acc Madd(Acc acc, Acc w, Acc x) { return _mm512_fmadd_ps(w, x, acc); }
  static Acc Scale(Acc acc, Acc sum, float scale) {
    return _mm512_fmadd_ps(sum, _mm512_set1_ps(scale), acc);
  }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc a) { return _mm512_reduce_add_ps(a); }
  static void Prefetch(const void* p) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  }
};
#else
struct Lanes {
  struct Acc {
    float lane[kLanes];
  };
  static Acc Widen(const int8_t* p) {
    Acc w;
    for (int64_t l = 0; l < kLanes; ++l) w.lane[l] = static_cast<float>(p[l]);
    return w;
  }
  static Acc Zero() { return Acc{}; }
  static Acc Load(const float* x) {
    Acc a;
    std::memcpy(a.lane, x, sizeof(a.lane));
    return a;
  }
  static Acc Madd(Acc acc, const Acc& w, const Acc& x) {
    for (int64_t l = 0; l < kLanes; ++l) acc.lane[l] += w.lane[l] * x.lane[l];
    return acc;
  }
  static Acc Scale(Acc acc, const Acc& sum, float scale) {
    for (int64_t l = 0; l < kLanes; ++l) acc.lane[l] += sum.lane[l] * scale;
    return acc;
  }
  static Acc Add(Acc a, const Acc& b) {
    for (int64_t l = 0; l < kLanes; ++l) a.lane[l] += b.lane[l];
    return a;
  }
  static float Sum(const Acc& a) {
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) sum += a.lane[l];
    return sum;
  }
  static void Prefetch(const void*) {}
};
#endif

// The table in int8 blocks: values [O, I], scales and offsets [O, I / G] (offsets null where
// the table has none).
struct Table {
  const int8_t* values;
  const float* scales;
  const float* offsets;
  int64_t outputs, inputs, group, groups;  // groups = inputs / group
};

// kRows rows of x: x [kRows, I] (f32) and, with offsets, each row's group sums [kRows, I / G].
struct Rows {
  const float* x;
  const float* group_sums;
};

// Group n of kTableRows table rows from `first` times kRows rows of x, added into acc: each 16
// weights widened once, each 16 of x loaded once for all table rows, one scaling per group.
// kSpans: the group's runs of 16 when known at compile time (GGUF's G = 16 and 32), else 0.
template <int64_t kRows, int64_t kTableRows, int64_t kSpans>
__attribute__((always_inline)) inline void Group(const Rows& xs, const Table& t, int64_t first,
                                                 int64_t n, Lanes::Acc (&acc)[kTableRows][kRows]) {
  const int64_t i = t.inputs, spans = kSpans ? kSpans : t.group / kLanes;
  Lanes::Acc sum[kTableRows][kRows];
  for (auto& row : sum) {
    for (auto& s : row) s = Lanes::Zero();
  }
  for (int64_t span = 0; span < spans; ++span) {
    const int64_t k = (n * spans + span) * kLanes;
    Lanes::Acc w[kTableRows];
    for (int64_t r = 0; r < kTableRows; ++r) w[r] = Lanes::Widen(t.values + (first + r) * i + k);
    for (int64_t b = 0; b < kRows; ++b) {
      const Lanes::Acc x = Lanes::Load(xs.x + b * i + k);
      for (int64_t r = 0; r < kTableRows; ++r) sum[r][b] = Lanes::Madd(sum[r][b], w[r], x);
    }
  }
  for (int64_t r = 0; r < kTableRows; ++r) {
    const float scale = t.scales[(first + r) * t.groups + n];
    for (int64_t b = 0; b < kRows; ++b) acc[r][b] = Lanes::Scale(acc[r][b], sum[r][b], scale);
  }
}

// kTableRows table rows from `first` times kRows rows of x, into out (row stride O): even and
// odd groups into accumulators of their own, added at the end.
template <int64_t kRows, int64_t kTableRows, int64_t kSpans, bool kOffsets>
__attribute__((always_inline)) inline void Tile(const Rows& xs, const Table& t, int64_t first,
                                                float* out) {
  const int64_t groups = t.groups;
  Lanes::Acc even[kTableRows][kRows], odd[kTableRows][kRows];
  for (int64_t r = 0; r < kTableRows; ++r) {
    for (int64_t b = 0; b < kRows; ++b) even[r][b] = odd[r][b] = Lanes::Zero();
  }
  int64_t n = 0;
  for (; n + 1 < groups; n += 2) {
    Group<kRows, kTableRows, kSpans>(xs, t, first, n, even);
    Group<kRows, kTableRows, kSpans>(xs, t, first, n + 1, odd);
  }
  if (n < groups) Group<kRows, kTableRows, kSpans>(xs, t, first, n, even);
  for (int64_t r = 0; r < kTableRows; ++r) {
    for (int64_t b = 0; b < kRows; ++b) {
      float total = Lanes::Sum(Lanes::Add(even[r][b], odd[r][b]));
      if (kOffsets) {
        const float* offsets = t.offsets + (first + r) * groups;
        const float* sums = xs.group_sums + b * groups;
        float shift = 0.0f;
        for (int64_t m = 0; m < groups; ++m) shift += offsets[m] * sums[m];
        total -= shift;
      }
      out[b * t.outputs + first + r] = total;
    }
  }
}

// kRows rows of x times every table row, a tile at a time (the last tile may be smaller),
// the rows kPrefetchTiles tiles ahead prefetched.
template <int64_t kRows, int64_t kSpans, bool kOffsets>
void Pass(const Rows& xs, const Table& t, float* out) {
  constexpr int64_t kTile = kRows <= 4 ? 2 : 1;  // more x rows leave registers for one table row
  int64_t row = 0;
  for (; row + kTile <= t.outputs; row += kTile) {
    // Written out here: GCC deletes a call of a function that only prefetches (no effects).
    const int64_t ahead = row + kPrefetchTiles * kTile;
    for (int64_t r = ahead; r < ahead + kTile && r < t.outputs; ++r) {
      for (int64_t c = 0; c < t.inputs; c += 64) Lanes::Prefetch(t.values + r * t.inputs + c);
      Lanes::Prefetch(t.scales + r * t.groups);
    }
    Tile<kRows, kTile, kSpans, kOffsets>(xs, t, row, out);
  }
  for (; row < t.outputs; ++row) Tile<kRows, 1, kSpans, kOffsets>(xs, t, row, out);
}

using PassFn = void (*)(const Rows&, const Table&, float*);

// The passes of 1 to kMaxRows rows of x (index: the rows) for groups of kSpans runs of 16.
template <int64_t kSpans, bool kOffsets>
constexpr PassFn kPasses[kMaxRows + 1] = {
    nullptr,
    Pass<1, kSpans, kOffsets>,
    Pass<2, kSpans, kOffsets>,
    Pass<3, kSpans, kOffsets>,
    Pass<4, kSpans, kOffsets>,
    Pass<5, kSpans, kOffsets>,
    Pass<6, kSpans, kOffsets>,
    Pass<7, kSpans, kOffsets>,
    Pass<8, kSpans, kOffsets>};

template <bool kOffsets>
void Passes(const float* x, const float* group_sums, int64_t rows, const Table& t, float* out) {
  // GGUF's group sizes unrolled at compile time (measured: the runtime loop ran ~2x slower).
  const PassFn* passes = t.group == 32   ? kPasses<2, kOffsets>
                         : t.group == 16 ? kPasses<1, kOffsets>
                                         : kPasses<0, kOffsets>;
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t n = rows - first < kMaxRows ? rows - first : kMaxRows;
    const Rows xs{x + first * t.inputs, group_sums ? group_sums + first * t.groups : nullptr};
    passes[n](xs, t, out + first * t.outputs);
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
                has_offsets ? offsets.typed_data() : nullptr, o, i, g, groups};
  if (has_offsets) {
    std::vector<float> group_sums(rows * groups, 0.0f);  // each x row's sum over each group
    for (int64_t k = 0; k < rows * i; ++k) group_sums[k / g] += xs[k];
    Passes<true>(xs.data(), group_sums.data(), rows, t, out->typed_data());
  } else {
    Passes<false>(xs.data(), nullptr, rows, t, out->typed_data());
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
