// One-shot EQuARX's two native steps on CPU, and two-shot's last, the XLA:CPU custom calls
// behind one_shot.py.
//
// RotateQuantize (one-shot's first step, and two-shot's encode of the chunks it sends): rotate
// each group of G values, quantize its rows of B, pack the payloads.
//
//   r[g, :]     = H_G x[g, :] / sqrt(G)         (hadamard = 1; else x[g, :]), f32, x bf16
//   scale[m]    = max(absmax over the finite r of row m * (1/127), FLT_MIN), a row being B
//                 consecutive values of r; with 2-byte scales rounded up to a bfloat16 value
//   codes[m, e] = clamp(round_half_even(r[m, e] * (1 / scale[m])), -127, 127); -128 if r is
//                 not finite
//   payload     = codes int8 [M, B] then scale [M] (f32, or bf16 bits), as bytes
//
// x is read flat: payload c (of `chunks`) holds its elements start + c M B .. (attribute
// `start`), zeros past its end, so a slice of a message, its padding included, is encoded
// straight from the message (no copy of the slice), and two-shot's N chunks in one call.
// The same arithmetic as block_quantize's jnp quantizer on the rotated values, so the codes are
// its codes for the same r (r itself is the FWHT's, see below, not XLA's dense product's).
// Cost: 2 M B bytes read, M (B + S) written a payload; log2(G) adds, a multiply and a round an
// element.
//
// DequantizeRotate (last step): dequantize K int8 payloads, sum them, rotate back.
//
//   v[m, :]   = sum_k codes[k, m, :] * scales[k, m]        in f32, k = 0, 1, ..., K-1 in order
//   out[m, :] = bf16(H_B v[m, :] / sqrt(B))                 (hadamard = 1; else bf16(v[m, :]))
//
// The K payloads arrive as all-gathered bytes, packed [K, M * (B + S)] u8: payload k is its
// codes int8 [M, B] then its scales [M], f32 (S = 4, native byte order) or bf16 bits (S = 2,
// attribute `scale_bytes`). B (attribute `block`) a power
// of two from 2 to 256. out bf16 is read flat: row m goes to its elements start + m B .. (those
// past its end dropped), the rest of out is not written; DequantizeRotateInto takes out as an
// operand that XLA aliases to the result, so a message's slices fill one buffer. The
// non-finite code (-128) decodes to NaN, and a NaN in a row makes the whole rotated row NaN, as
// the dense product by H does. H_B v / sqrt(B) is the fast Walsh-Hadamard transform: log2(B)
// stages of sums and differences of pairs (stride B/2 first), each value rounded once a stage,
// halved after every second stage (see Fwht). The f32 -> bf16 step
// rounds to nearest even, NaN stays NaN. No fused multiply-adds (-ffp-contract=off), so every
// build gives the same bits.
//
// Cost: K * M * (B + S) bytes read, 2 * M * B written; per element K multiplies, K - 1
// adds and log2(B) adds. One pass over the data, a row at a time in a stack array: memory-bound
// (XLA:CPU's dense [B, B] product by H costs B multiply-adds an element instead of log2(B)).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using equarx::Bf16ToF32;
using equarx::F32ToBf16;

constexpr int8_t kNonFiniteCode = -128;
constexpr int64_t kMaxBlock = 256;

constexpr float kInt8Max = 127.0f;

// In-place orthonormal fast Walsh-Hadamard transform of B values: log2(B) stages, stride B/2
// first, each value halved after every second stage (exact, and the values never grow past
// twice the output's bound, so no stage overflows where the result does not), and for odd
// log2(B) a last multiply by 1/sqrt(2) (rounded).
template <int64_t B>
inline void Fwht(float* v) {
  int stage = 0;
  for (int64_t half = B / 2; half >= 1; half /= 2) {
    ++stage;
    for (int64_t start = 0; start < B; start += 2 * half) {
      for (int64_t j = start; j < start + half; ++j) {
        const float a = v[j], b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
    }
    if (stage % 2 == 0) {
      for (int64_t e = 0; e < B; ++e) v[e] *= 0.5f;
    }
  }
  if (stage % 2 == 1) {
    const float inv_sqrt2 = 1.0f / std::sqrt(2.0f);
    for (int64_t e = 0; e < B; ++e) v[e] *= inv_sqrt2;
  }
}

// Payload p of `packed` (p * stride bytes in): its codes int8 [m, block], then its scales [m]
// at m * block bytes in, as f32 (4 bytes) or bf16 (2 bytes); row 0 of the view is the
// payloads' row `first`.
struct Payloads {
  const uint8_t* packed;
  int64_t stride, m, block, scale_bytes = 4, first = 0;
  const int8_t* Codes(int64_t p, int64_t row) const {
    return reinterpret_cast<const int8_t*>(packed + p * stride + (first + row) * block);
  }
  float Scale(int64_t p, int64_t row) const {  // the scales may sit at any byte offset
    const uint8_t* at = packed + p * stride + m * block + (first + row) * scale_bytes;
    if (scale_bytes == 2) {
      uint16_t bits;
      std::memcpy(&bits, at, sizeof(bits));
      return Bf16ToF32(bits);
    }
    float scale;
    std::memcpy(&scale, at, sizeof(scale));
    return scale;
  }
};

// Rows 0 .. rows - 1 of the view `in`, written to out[row * B ..].
template <int64_t B>
void Rows(const Payloads& in, uint16_t* out, int64_t k, bool hadamard, int64_t rows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  alignas(64) float v[B];
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t e = 0; e < B; ++e) v[e] = 0.0f;
    for (int64_t p = 0; p < k; ++p) {
      const int8_t* q = in.Codes(p, row);
      const float s = in.Scale(p, row);
      for (int64_t e = 0; e < B; ++e) {
        const float decoded = q[e] == kNonFiniteCode ? nan : static_cast<float>(q[e]) * s;
        v[e] = p == 0 ? decoded : v[e] + decoded;
      }
    }
    if (hadamard) Fwht<B>(v);
    uint16_t* o = out + row * B;
    for (int64_t e = 0; e < B; ++e) o[e] = F32ToBf16(v[e]);
  }
}

// DecodeRotateEach (two-shot's last step): K payloads of different chunks, each decoded on its
// own and rotated back in groups of G = k B elements (k consecutive rows of one payload), into
// rows first .. first + M - 1 of each chunk of out [K, R, B] (R >= first + M):
//
//   out[p, first + g, :] = bf16(H_G (codes[p, rows of g] * their scales) / sqrt(G))
//
// payload p: codes int8 [M, B] then scales [M] as f32 (4 bytes) or bf16 (2 bytes). Per element
// one multiply and log2(G) adds; one pass over K M (B + S) bytes in, 2 K M B out. `out` below
// is the first row's start, chunk p's row r at out + (p R + r) B.

template <int64_t G>
void EachGroups(const Payloads& in, uint16_t* out, int64_t k, int64_t out_rows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t rows_per_group = G / in.block;
  alignas(64) float v[G];
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t row = 0; row < in.m; row += rows_per_group) {
      for (int64_t e = 0; e < G; ++e) {
        const int64_t r = row + e / in.block;
        const int8_t q = in.Codes(p, r)[e % in.block];
        v[e] = q == kNonFiniteCode ? nan : static_cast<float>(q) * in.Scale(p, r);
      }
      Fwht<G>(v);
      uint16_t* o = out + (p * out_rows + row) * in.block;
      for (int64_t e = 0; e < G; ++e) o[e] = F32ToBf16(v[e]);
    }
  }
}

#if defined(__AVX512F__)
// B = 64 (the default rotation block) with AVX-512: a row in four registers of 16 lanes. The
// same arithmetic as Rows<64>, in the same order: strides 32 and 16 pair whole registers;
// strides 8, 4, 2, 1 pair the lanes of one register (a permute brings each lane's partner; the
// lower lane keeps the sum, the upper the difference).
inline __m512 Decode16(const int8_t* q, __m512 scale, __m512 nan) {
  const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __mmask16 bad = _mm512_cmpeq_epi32_mask(codes, _mm512_set1_epi32(kNonFiniteCode));
  return _mm512_mask_blend_ps(bad, _mm512_mul_ps(_mm512_cvtepi32_ps(codes), scale), nan);
}

inline __m512 InLaneStage(__m512 x, __m512i partner, __mmask16 upper) {
  const __m512 p = _mm512_permutexvar_ps(partner, x);
  return _mm512_mask_blend_ps(upper, _mm512_add_ps(x, p), _mm512_sub_ps(p, x));
}

inline __m256i ToBf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

// H_64 v / 8 of a row in four registers, as Fwht<64>.
inline void Fwht64(__m512 v[4], const __m512i partner[4], const __mmask16 upper[4], __m512 halve) {
  for (int half = 2; half >= 1; half /= 2) {  // strides 32 and 16: registers r, r + half
    for (int start = 0; start < 4; start += 2 * half) {
      for (int r = start; r < start + half; ++r) {
        const __m512 a = v[r], b = v[r + half];
        v[r] = _mm512_add_ps(a, b);
        v[r + half] = _mm512_sub_ps(a, b);
      }
    }
  }
  for (int r = 0; r < 4; ++r) v[r] = _mm512_mul_ps(v[r], halve);  // after stage 2
  for (int stage = 0; stage < 4; ++stage) {
    for (int r = 0; r < 4; ++r) v[r] = InLaneStage(v[r], partner[stage], upper[stage]);
    if (stage % 2 == 1) {  // after stages 4 and 6
      for (int r = 0; r < 4; ++r) v[r] = _mm512_mul_ps(v[r], halve);
    }
  }
}

// The lane permutations of Fwht64's in-register stages (strides 8, 4, 2, 1).
struct InLane {
  __m512i partner[4];
  __mmask16 upper[4];
  InLane() {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int stage = 0; stage < 4; ++stage) {
      const int stride = 8 >> stage;
      partner[stage] = _mm512_xor_si512(lane, _mm512_set1_epi32(stride));
      upper[stage] = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(stride));
    }
  }
};

void Rows64Avx512(const Payloads& in, uint16_t* out, int64_t k, bool hadamard, int64_t rows) {
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512 halve = _mm512_set1_ps(0.5f);
  const InLane lanes;
  for (int64_t row = 0; row < rows; ++row) {
    __m512 v[4];
    for (int64_t p = 0; p < k; ++p) {
      const int8_t* q = in.Codes(p, row);
      const __m512 scale = _mm512_set1_ps(in.Scale(p, row));
      for (int r = 0; r < 4; ++r) {
        const __m512 decoded = Decode16(q + 16 * r, scale, nan);
        v[r] = p == 0 ? decoded : _mm512_add_ps(v[r], decoded);
      }
    }
    if (hadamard) {
      Fwht64(v, lanes.partner, lanes.upper, halve);
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row * 64 + 16 * r), ToBf16(v[r]));
    }
  }
}

// EachGroups<64> with AVX-512 (B = 16, 32 or 64): a group in four registers, register r holding
// elements 16 r .. 16 r + 15, all of one row; the same arithmetic in the same order.
void EachGroups64Avx512(const Payloads& in, uint16_t* out, int64_t k, int64_t out_rows) {
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512 halve = _mm512_set1_ps(0.5f);
  const InLane lanes;
  const int64_t rows_per_group = 64 / in.block;
  for (int64_t p = 0; p < k; ++p) {
    for (int64_t row = 0; row < in.m; row += rows_per_group) {
      const int8_t* q = in.Codes(p, row);  // the group's rows are consecutive
      __m512 v[4];
      for (int r = 0; r < 4; ++r) {
        const __m512 scale = _mm512_set1_ps(in.Scale(p, row + 16 * r / in.block));
        v[r] = Decode16(q + 16 * r, scale, nan);
      }
      Fwht64(v, lanes.partner, lanes.upper, halve);
      uint16_t* o = out + (p * out_rows + row) * in.block;
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * r), ToBf16(v[r]));
      }
    }
  }
}
#endif

// The smallest scale that keeps a row of absmax `absmax` within [-127, 127] codes: f32, or the
// smallest bfloat16 value >= it for scales of 2 bytes (block_quantize's arithmetic).
inline float RowScale(float absmax, int64_t scale_bytes) {
  float scale = std::fmax(absmax * (1.0f / kInt8Max), std::numeric_limits<float>::min());
  if (scale_bytes == 2) {
    uint32_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    bits = (bits + 0xFFFFu) & 0xFFFF0000u;
    std::memcpy(&scale, &bits, sizeof(scale));
  }
  return scale;
}

// A scale as its bytes on the wire: f32, or the upper half of an f32 that RowScale made exact
// in bfloat16.
inline void StoreScale(float scale, int64_t scale_bytes, uint8_t* at) {
  if (scale_bytes == 2) {
    uint32_t bits;
    std::memcpy(&bits, &scale, sizeof(bits));
    const uint16_t upper = static_cast<uint16_t>(bits >> 16);
    std::memcpy(at, &upper, sizeof(upper));
  } else {
    std::memcpy(at, &scale, sizeof(scale));
  }
}

// One row of `block` rotated values -> its codes and scale (block_quantize's arithmetic).
inline void QuantizeRow(const float* r, int64_t block, int64_t scale_bytes, int8_t* codes,
                        uint8_t* scale_at) {
  float absmax = 0.0f;
  for (int64_t e = 0; e < block; ++e) {
    if (std::isfinite(r[e])) absmax = std::fmax(absmax, std::fabs(r[e]));
  }
  const float scale = RowScale(absmax, scale_bytes);
  const float inverse = 1.0f / scale;
  for (int64_t e = 0; e < block; ++e) {
    if (!std::isfinite(r[e])) {
      codes[e] = kNonFiniteCode;
      continue;
    }
    const float q = std::nearbyint(r[e] * inverse);  // the default mode: nearest, ties to even
    codes[e] = static_cast<int8_t>(std::fmin(std::fmax(q, -kInt8Max), kInt8Max));
  }
  StoreScale(scale, scale_bytes, scale_at);
}

// Where QuantizeGroups writes: codes int8 [rows, block] and scales [rows] of scale_bytes each.
struct Quantized {
  uint8_t* codes;
  uint8_t* scales;
  int64_t block, scale_bytes;
  int8_t* Codes(int64_t row) const { return reinterpret_cast<int8_t*>(codes + row * block); }
  uint8_t* Scale(int64_t row) const { return scales + row * scale_bytes; }
};

// Payloads a device received for the chunk it quantizes, added (decoded) before quantizing:
// k payloads of the chunk's rows (codes, then scales), row 0 of a call being their row `first`.
struct Received {
  const Payloads* payloads = nullptr;
  int64_t k = 0, first = 0;
};

// `groups` groups of G values of x (G / block rows each), each rotated (hadamard), plus the
// received payloads decoded and added in order, then quantized row by row.
template <int64_t G>
void QuantizeGroups(const uint16_t* x, const Received& in, const Quantized& out, int64_t groups,
                    bool hadamard) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  alignas(64) float r[G];
  const int64_t rows_per_group = G / out.block;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t e = 0; e < G; ++e) r[e] = Bf16ToF32(x[g * G + e]);
    if (hadamard) Fwht<G>(r);
    for (int64_t p = 0; p < in.k; ++p) {
      for (int64_t e = 0; e < G; ++e) {
        const int64_t row = in.first + g * rows_per_group + e / out.block;
        const int8_t q = in.payloads[p].Codes(0, row)[e % out.block];
        r[e] += q == kNonFiniteCode ? nan : static_cast<float>(q) * in.payloads[p].Scale(0, row);
      }
    }
    for (int64_t j = 0; j < rows_per_group; ++j) {
      const int64_t row = g * rows_per_group + j;
      QuantizeRow(r + j * out.block, out.block, out.scale_bytes, out.Codes(row), out.Scale(row));
    }
  }
}

#if defined(__AVX512F__)
// QuantizeGroups<64> with AVX-512 (blocks of 16, 32 or 64), the same arithmetic: a group in
// four registers, a row in block / 16 of them.
void QuantizeGroups64Avx512(const uint16_t* x, const Received& in, const Quantized& out,
                            int64_t groups, bool hadamard) {
  const InLane lanes;
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512 halve = _mm512_set1_ps(0.5f);
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  const int regs_per_row = static_cast<int>(out.block / 16);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 v[4];
    for (int r = 0; r < 4; ++r) {  // a bf16 is the high half of an f32
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * 64 + 16 * r));
      v[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    if (hadamard) Fwht64(v, lanes.partner, lanes.upper, halve);
    for (int64_t p = 0; p < in.k; ++p) {  // the group's rows are consecutive
      const int64_t row = in.first + g * (64 / out.block);
      const int8_t* q = in.payloads[p].Codes(0, row);
      for (int r = 0; r < 4; ++r) {
        const __m512 scale = _mm512_set1_ps(in.payloads[p].Scale(0, row + 16 * r / out.block));
        v[r] = _mm512_add_ps(v[r], Decode16(q + 16 * r, scale, nan));
      }
    }
    for (int first = 0; first < 4; first += regs_per_row) {
      const int64_t row = g * (64 / out.block) + first / regs_per_row;
      __mmask16 finite[4];
      __m512 absmax = _mm512_setzero_ps();
      for (int r = first; r < first + regs_per_row; ++r) {
        const __m512 magnitude = _mm512_castsi512_ps(
            _mm512_and_si512(_mm512_castps_si512(v[r]), _mm512_set1_epi32(0x7fffffff)));
        finite[r] = _mm512_cmp_ps_mask(magnitude, largest, _CMP_LE_OQ);
        absmax = _mm512_mask_max_ps(absmax, finite[r], absmax, magnitude);
      }
      const float scale = RowScale(_mm512_reduce_max_ps(absmax), out.scale_bytes);
      const __m512 inverse = _mm512_set1_ps(1.0f / scale);
      int8_t* codes = out.Codes(row);
      for (int r = first; r < first + regs_per_row; ++r) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v[r], inverse),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-kInt8Max)), _mm512_set1_ps(kInt8Max));
        const __m512i ints = _mm512_mask_blend_epi32(
            finite[r], _mm512_set1_epi32(kNonFiniteCode), _mm512_cvtps_epi32(q));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * (r - first)),
                         _mm512_cvtepi32_epi8(ints));
      }
      StoreScale(scale, out.scale_bytes, out.Scale(row));
    }
  }
}
#endif

using QuantizeFn = void (*)(const uint16_t*, const Received&, const Quantized&, int64_t, bool);

// The loop for groups of `group` values made of rows of `block` (block divides group).
QuantizeFn QuantizeFor(int64_t group, int64_t block) {
  switch (group) {
    case 2: return QuantizeGroups<2>;
    case 4: return QuantizeGroups<4>;
    case 8: return QuantizeGroups<8>;
    case 16: return QuantizeGroups<16>;
    case 32: return QuantizeGroups<32>;
#if defined(__AVX512F__)
    case 64: return block >= 16 ? QuantizeGroups64Avx512 : QuantizeGroups<64>;
#else
    case 64: return QuantizeGroups<64>;
#endif
    case 128: return QuantizeGroups<128>;
    case 256: return QuantizeGroups<256>;
    default: return nullptr;
  }
}

// QuantizeFor for payloads of `bytes` bytes: rows of `block` codes and a scale of `scale_bytes`,
// in whole groups of `group`; nullptr where that is not such a layout.
QuantizeFn QuantizeLayout(int64_t block, int64_t group, int64_t scale_bytes, int64_t bytes) {
  const bool blocks_fit = block >= 1 && !(block & (block - 1)) && group % block == 0;
  const int64_t per_row = block + scale_bytes;
  if (!blocks_fit || group > kMaxBlock || (scale_bytes != 2 && scale_bytes != 4) ||
      bytes % per_row != 0 || (bytes / per_row * block) % group != 0) {
    return nullptr;
  }
  return QuantizeFor(group, block);
}

// `groups` groups of `group` elements of x (read flat, `size` elements) from element `first`
// through `quantize`: the groups inside x straight from it, the one x's end cuts and any past
// it staged with zeros (the message's padding); the received rows line up with out's.
void QuantizeFrom(QuantizeFn quantize, const uint16_t* x, int64_t size, int64_t first,
                  int64_t groups, int64_t group, const Received& in, const Quantized& out,
                  bool hadamard) {
  const int64_t whole = std::clamp<int64_t>((size - first) / group, 0, groups);
  if (whole > 0) quantize(x + first, in, out, whole, hadamard);
  alignas(64) uint16_t staged[kMaxBlock];
  for (int64_t g = whole; g < groups; ++g) {
    const int64_t at = first + g * group;
    const int64_t inside = std::clamp<int64_t>(size - at, 0, group);
    std::memset(staged, 0, sizeof(staged));
    if (inside > 0) std::memcpy(staged, x + at, inside * sizeof(uint16_t));
    const int64_t row = g * (group / out.block);
    const Quantized one{out.codes + row * out.block, out.Scale(row), out.block, out.scale_bytes};
    quantize(staged, Received{in.payloads, in.k, in.first + row}, one, 1, hadamard);
  }
}

using RowsFn = void (*)(const Payloads&, uint16_t*, int64_t, bool, int64_t);

RowsFn RowsFor(int64_t block) {
  switch (block) {
    case 2: return Rows<2>;
    case 4: return Rows<4>;
    case 8: return Rows<8>;
    case 16: return Rows<16>;
    case 32: return Rows<32>;
#if defined(__AVX512F__)
    case 64: return Rows64Avx512;
#else
    case 64: return Rows<64>;
#endif
    case 128: return Rows<128>;
    case 256: return Rows<256>;
    default: return nullptr;
  }
}

// The payloads' M rows of B elements are elements start .. start + M B - 1 of out (`size`
// elements): the rows up to out's end are written, the elements past it dropped (the message's
// padding); nothing else of out is touched.
ffi::Error DequantizeRotateAt(ffi::Buffer<ffi::U8> packed, uint16_t* out, int64_t size,
                              int64_t block, int64_t scale_bytes, int64_t hadamard,
                              int64_t start) {
  auto dims = packed.dimensions();
  RowsFn rows = block <= kMaxBlock ? RowsFor(block) : nullptr;
  if (rows == nullptr || (scale_bytes != 2 && scale_bytes != 4)) {
    return ffi::Error::InvalidArgument(
        "dequantize_rotate: want a power-of-two block of 2 to 256, scales of 2 or 4 bytes");
  }
  const int64_t per_row = block + scale_bytes;
  if (dims.size() != 2 || dims[0] < 1 || dims[1] % per_row != 0) {
    return ffi::Error::InvalidArgument(
        "dequantize_rotate: want packed payloads [K, M * (block + scale bytes)] bytes, K >= 1");
  }
  if (start < 0) return ffi::Error::InvalidArgument("dequantize_rotate: want start >= 0");
  Payloads in{packed.typed_data(), dims[1], dims[1] / per_row, block, scale_bytes};
  const int64_t count = std::max<int64_t>(0, std::min(in.m * block, size - start));
  if (count == 0) return ffi::Error::Success();
  rows(in, out + start, dims[0], hadamard != 0, count / block);
  if (count % block != 0) {  // the last row is cut by the output's end
    alignas(64) uint16_t row[kMaxBlock];
    in.first = count / block;
    rows(in, row, dims[0], hadamard != 0, 1);
    std::memcpy(out + start + count / block * block, row, (count % block) * sizeof(uint16_t));
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeRotate(ffi::Buffer<ffi::U8> packed, ffi::ResultBuffer<ffi::BF16> out,
                            int64_t block, int64_t scale_bytes, int64_t hadamard, int64_t start) {
  return DequantizeRotateAt(packed, reinterpret_cast<uint16_t*>(out->typed_data()),
                            static_cast<int64_t>(out->element_count()), block, scale_bytes,
                            hadamard, start);
}

// out, holding into's values: XLA aliases the two (input_output_aliases), so usually nothing
// to do; where it did not, a copy keeps the semantics. `kernel` names the caller in the error.
ffi::Error StartFrom(ffi::Buffer<ffi::BF16> into, ffi::ResultBuffer<ffi::BF16> out,
                     const char* kernel) {
  if (into.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument(std::string(kernel) + ": into and out differ in size");
  }
  if (into.untyped_data() != out->untyped_data()) {
    std::memcpy(out->untyped_data(), into.untyped_data(), into.size_bytes());
  }
  return ffi::Error::Success();
}

// DequantizeRotate into `into`, which XLA aliases to the result (input_output_aliases): the
// other elements keep into's values, so a message's slices fill one buffer without copies.
// Operands after `into` are only held (not read): buffers the caller keeps live until here.
ffi::Error DequantizeRotateInto(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::BF16> into,
                                ffi::RemainingArgs /*held*/,
                                ffi::ResultBuffer<ffi::BF16> out, int64_t block,
                                int64_t scale_bytes, int64_t hadamard, int64_t start) {
  if (ffi::Error started = StartFrom(into, out, "dequantize_rotate"); started.failure()) {
    return started;
  }
  return DequantizeRotateAt(packed, reinterpret_cast<uint16_t*>(out->typed_data()),
                            static_cast<int64_t>(out->element_count()), block, scale_bytes,
                            hadamard, start);
}

using EachFn = void (*)(const Payloads&, uint16_t*, int64_t, int64_t);

// The loop for groups of `group` elements made of rows of `block` (block divides group).
EachFn EachFor(int64_t group, int64_t block) {
  switch (group) {
    case 2: return EachGroups<2>;
    case 4: return EachGroups<4>;
    case 8: return EachGroups<8>;
    case 16: return EachGroups<16>;
    case 32: return EachGroups<32>;
#if defined(__AVX512F__)
    case 64: return block >= 16 ? EachGroups64Avx512 : EachGroups<64>;  // a register, one row
#else
    case 64: return EachGroups<64>;
#endif
    case 128: return EachGroups<128>;
    case 256: return EachGroups<256>;
    default: return nullptr;
  }
}

// `work` on a thread of its own; the future completes when it has run. Two-shot's kernels
// (ReduceChunk, DecodeRotateEach) run this way: XLA:CPU runs a program's operations one at a time
// on the thread that finished the last one, and a gloo collective blocks that thread for its
// whole transfer, so a kernel run there stops the wire (an encode before the first transfer, a
// reduce between them, a decode after them). Returned as a future, the kernel runs while XLA
// goes on with the next collective; XLA waits for it before anything that reads its result and
// keeps its operands until then. With two-shot's encode split by chunk (ring.py), 4 emulated
// hosts at 1 Gbit/s, A/B twice: 16 MiB 141-142 vs 145-148 ms, 64 MiB 580-586 vs 615-656 ms.
// A thread per call (a thread starts in microseconds, the kernels take milliseconds), never a
// fixed pool: the thread that completes a future goes on with the program, which may block it
// in a collective, and fake devices of one process meet in every collective, so waits on a
// pool could exhaust it.
ffi::Future Later(std::function<void()> work) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::thread([promise, work = std::move(work)]() mutable {
    work();
    promise.SetAvailable();
  }).detach();
  return future;
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// DecodeRotateEach into out (`size` elements, [K, R, B]) from row `first` of each chunk.
ffi::Future DecodeRotateEachAt(ffi::Buffer<ffi::U8> packed, uint16_t* out, int64_t size,
                               int64_t block, int64_t group, int64_t scale_bytes, int64_t first) {
  auto dims = packed.dimensions();
  const bool blocks_fit = block >= 1 && group % block == 0 && !(block & (block - 1));
  EachFn each = blocks_fit && group <= kMaxBlock ? EachFor(group, block) : nullptr;
  if (each == nullptr || (scale_bytes != 2 && scale_bytes != 4)) {
    return Failed(ffi::Error::InvalidArgument(
        "decode_rotate_each: want a power-of-two group of 2 to 256 elements made of whole "
        "power-of-two blocks, scales of 2 or 4 bytes"));
  }
  const int64_t per_row = block + scale_bytes;
  if (dims.size() != 2 || dims[0] < 1 || dims[1] % per_row != 0 ||
      (dims[1] / per_row) % (group / block) != 0) {
    return Failed(ffi::Error::InvalidArgument(
        "decode_rotate_each: want payloads [K, M * (block + scale bytes)] bytes, K >= 1, M a "
        "multiple of group / block"));
  }
  const Payloads in{packed.typed_data(), dims[1], dims[1] / per_row, block, scale_bytes};
  const int64_t k = dims[0];
  const int64_t out_rows = size % (k * block) == 0 ? size / (k * block) : -1;
  if (first < 0 || out_rows < first + in.m) {
    return Failed(ffi::Error::InvalidArgument(
        "decode_rotate_each: want out [K, R, block] with R >= first + M, first >= 0"));
  }
  uint16_t* to = out + first * block;
  return Later([=] { each(in, to, k, out_rows); });
}

// Operands after `packed` are only held (not read), as in DequantizeRotateInto.
ffi::Future DecodeRotateEach(ffi::Buffer<ffi::U8> packed, ffi::RemainingArgs /*held*/,
                             ffi::ResultBuffer<ffi::BF16> out, int64_t block, int64_t group,
                             int64_t scale_bytes, int64_t first) {
  return DecodeRotateEachAt(packed, reinterpret_cast<uint16_t*>(out->typed_data()),
                            static_cast<int64_t>(out->element_count()), block, group,
                            scale_bytes, first);
}

// DecodeRotateEach into `into`, which XLA aliases to the result (input_output_aliases): the
// other rows keep into's values, so the pieces of an all-gather fill one buffer without copies.
ffi::Future DecodeRotateEachInto(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::BF16> into,
                                 ffi::RemainingArgs /*held*/, ffi::ResultBuffer<ffi::BF16> out,
                                 int64_t block, int64_t group, int64_t scale_bytes,
                                 int64_t first) {
  if (ffi::Error started = StartFrom(into, out, "decode_rotate_each"); started.failure()) {
    return Failed(std::move(started));
  }
  return DecodeRotateEachAt(packed, reinterpret_cast<uint16_t*>(out->typed_data()),
                            static_cast<int64_t>(out->element_count()), block, group,
                            scale_bytes, first);
}

// `chunks` payloads of M rows of `block` elements each (M = out's bytes per chunk / (block +
// scale_bytes)): chunk c holds x's elements start + c M block .. (x read flat, zeros past its
// end), rotated in groups of `group` elements (hadamard; group a multiple of block dividing
// M block), as codes int8 [M, block] then scales [M] (f32, or bfloat16 rounded up).
// Operands after x are only held (not read), as in DequantizeRotateInto.
ffi::Error RotateQuantize(ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs /*held*/,
                          ffi::ResultBuffer<ffi::U8> out, int64_t block, int64_t group,
                          int64_t scale_bytes, int64_t hadamard, int64_t start, int64_t chunks) {
  const int64_t total = static_cast<int64_t>(out->element_count());
  const int64_t per_chunk = chunks >= 1 && total % chunks == 0 ? total / chunks : -1;
  QuantizeFn quantize = per_chunk >= 0 ? QuantizeLayout(block, group, scale_bytes, per_chunk)
                                       : nullptr;
  if (quantize == nullptr) {
    return ffi::Error::InvalidArgument(
        "rotate_quantize: want a power-of-two group of 2 to 256 elements made of whole "
        "power-of-two blocks, scales of 2 or 4 bytes, and out [chunks * M * (block + scale "
        "bytes)] bytes with M rows a chunk of whole groups");
  }
  if (start < 0) return ffi::Error::InvalidArgument("rotate_quantize: want start >= 0");
  const int64_t m = per_chunk / (block + scale_bytes), groups = m * block / group;
  const auto* x_flat = reinterpret_cast<const uint16_t*>(x.typed_data());
  for (int64_t c = 0; c < chunks; ++c) {
    uint8_t* codes = out->typed_data() + c * per_chunk;
    const Quantized chunk{codes, codes + m * block, block, scale_bytes};
    QuantizeFrom(quantize, x_flat, static_cast<int64_t>(x.element_count()),
                 start + c * m * block, groups, group, Received{}, chunk, hadamard != 0);
  }
  return ffi::Error::Success();
}

// ReduceChunk (two-shot's owner step): the device's own chunk, M rows of `block` elements of x
// (read flat from element `start`, an s32 operand since the owner's chunk is traced; zeros past
// x's end), rotated in groups of `group` (hadamard), plus the K received payloads of that chunk
// decoded and added in order (f32), quantized into one payload as RotateQuantize lays it out.
// A received payload may hold more rows (a whole chunk where out is a piece of it): payload k's
// rows firsts[k] .. firsts[k] + M - 1 are added:
//
//   acc = H_G x[chunk] / sqrt(G) + sum_k codes[k] * scales[k]     (k = 0, 1, ... in order)
//
// the arithmetic of block_quantize's accumulate-quantize on the rotated values. Cost per
// element: 2 bytes read and K (1 + S / B) more, 1 + S / B written; log2(G) adds, K
// multiply-adds, a multiply and a round.
ffi::Future ReduceChunk(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> start,
                        ffi::RemainingArgs received, ffi::ResultBuffer<ffi::U8> out,
                        int64_t block, int64_t group, int64_t scale_bytes, int64_t hadamard,
                        ffi::Span<const int64_t> firsts) {
  const int64_t total = static_cast<int64_t>(out->element_count());
  QuantizeFn quantize = QuantizeLayout(block, group, scale_bytes, total);
  if (quantize == nullptr || start.element_count() != 1) {
    return Failed(ffi::Error::InvalidArgument(
        "reduce_chunk: want a power-of-two group of 2 to 256 elements made of whole "
        "power-of-two blocks, scales of 2 or 4 bytes, out [M * (block + scale bytes)] bytes of "
        "whole groups, and one start"));
  }
  const int64_t first = start.typed_data()[0];
  if (first < 0) return Failed(ffi::Error::InvalidArgument("reduce_chunk: want start >= 0"));
  constexpr size_t kMaxReceived = 64;
  if (received.size() > kMaxReceived) {
    return Failed(ffi::Error::InvalidArgument("reduce_chunk: at most 64 received payloads"));
  }
  const int64_t per_row = block + scale_bytes, m = total / per_row;
  if (firsts.size() != received.size()) {
    return Failed(ffi::Error::InvalidArgument("reduce_chunk: want a first row per payload"));
  }
  std::vector<Payloads> payloads(received.size());
  for (size_t p = 0; p < received.size(); ++p) {
    auto payload = received.get<ffi::Buffer<ffi::U8>>(p);
    const int64_t bytes = payload.has_value() ? payload->element_count() : 0;
    if (firsts[p] < 0 || bytes % per_row != 0 || bytes / per_row < firsts[p] + m) {
      return Failed(ffi::Error::InvalidArgument(
          "reduce_chunk: want received payloads of whole rows, first + out's rows at least"));
    }
    payloads[p] = Payloads{payload->typed_data(), bytes, bytes / per_row, block, scale_bytes,
                           firsts[p]};
  }
  const auto* x_flat = reinterpret_cast<const uint16_t*>(x.typed_data());
  const int64_t size = static_cast<int64_t>(x.element_count());
  uint8_t* codes = out->typed_data();
  return Later([=, payloads = std::move(payloads)] {
    const Received in{payloads.data(), static_cast<int64_t>(payloads.size()), 0};
    QuantizeFrom(quantize, x_flat, size, first, m * block / group, group, in,
                 Quantized{codes, codes + m * block, block, scale_bytes}, hadamard != 0);
  });
}

}  // namespace

// Whether this build has the AVX-512 loops: the plain ones run slower than XLA's own ops (8 Mi
// elements, one thread: quantize 66 vs 6 ms, decode 43 vs 7 ms), so one_shot.py uses the
// kernels only where this is 1.
extern "C" int EquarxOneShotVectorized() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxRotateQuantize, RotateQuantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("hadamard")
                                  .Attr<int64_t>("start")
                                  .Attr<int64_t>("chunks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxReduceChunk, ReduceChunk,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("hadamard")
                                  .Attr<ffi::Span<const int64_t>>("firsts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxDecodeRotateEach, DecodeRotateEach,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("first"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxDecodeRotateEachInto, DecodeRotateEachInto,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("first"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxDequantizeRotate, DequantizeRotate,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("hadamard")
                                  .Attr<int64_t>("start"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxDequantizeRotateInto, DequantizeRotateInto,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("scale_bytes")
                                  .Attr<int64_t>("hadamard")
                                  .Attr<int64_t>("start"));
