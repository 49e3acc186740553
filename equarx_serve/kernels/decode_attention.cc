// One decode step's attention over a bf16 KV cache, the cache read once: the XLA:CPU custom
// call behind decode_attention.py.
//
//   out[b, n] = sum_s p[b, n, s] v[b, s, n / G],  p = softmax_s(q[b, n] . k[b, s, n / G])
//   over the keys first[b] <= s <= last[b]
//
//   query [B, N, H] bf16 (already scaled), key and value [B', S, K, H] bf16 (the cache, whose
//   first B rows are the queries'; B' >= B: a step of fewer sequences than the cache has rows
//   reads its rows in place), first and last [B] int32, out [B, N, H] bf16; G = N / K query
//   heads share a key/value head; attribute softcap (0: none): logits c * tanh(logits / c).
//
// For each row and key/value head, its G queries (widened to f32 once) go over the visible
// keys: every key row is loaded once for all G queries (16 bf16 widened to f32, FMA), each
// logit rounded to bf16 as the model's bf16 einsum gives it; then the softmax in f32 (max,
// exp, sum), each probability rounded to bf16 (as the model's bf16 softmax hands it to the
// value einsum), and every value row, loaded once for the G queries, added in f32 with its
// probability; the output rounded to bf16. The XLA formulation (models/attention.py, in the
// model's dtypes) rounds the softmax's intermediate steps to bf16 too, so the two differ
// within bf16 roundings, not more.
//   AVX-512F   16 bf16 widened to f32 (a bf16 is the high half of an f32), then FMA;
//   otherwise  plain loops over 16 lanes, for the compiler to vectorize.
// Single-threaded: XLA:CPU runs each device's program on its own thread.
//
// Cost per row and KV head: 2 * L * H * 2 bytes read (L = last - first + 1 keys, and as many
// values), 4 * G * L * H FLOPs; XLA:CPU's dots ran it at a fraction of that, with a copy of
// the key cache into another layout every step.

#include <algorithm>
#include <cmath>
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
using equarx::F32ToBf16;

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroup = 8;  // query heads per KV head in one pass

inline float RoundBf16(float value) { return Bf16ToF32(F32ToBf16(value)); }

#if defined(__AVX512F__)
inline __m512 Widen(const uint16_t* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
#endif

// logits[g] = q[g] . key for the g < groups queries q [groups, h] (f32) and one key row [h].
inline void Dots(const float* q, int64_t groups, const uint16_t* key, int64_t h, float* logits) {
#if defined(__AVX512F__)
  if (h % kLanes == 0) {
    __m512 acc[kMaxGroup];
    for (int64_t g = 0; g < groups; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t e = 0; e < h; e += kLanes) {
      const __m512 k = Widen(key + e);
      for (int64_t g = 0; g < groups; ++g) {
        acc[g] = _mm512_fmadd_ps(k, _mm512_loadu_ps(q + g * h + e), acc[g]);
      }
    }
    for (int64_t g = 0; g < groups; ++g) logits[g] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
    float sum = 0.0f;
    for (int64_t e = 0; e < h; ++e) sum += q[g * h + e] * Bf16ToF32(key[e]);
    logits[g] = sum;
  }
}

// out[g] += p[g] * value for the g < groups accumulators out [groups, h] (f32).
inline void Accumulate(const float* p, int64_t groups, const uint16_t* value, int64_t h,
                       float* out) {
#if defined(__AVX512F__)
  if (h % kLanes == 0) {
    for (int64_t e = 0; e < h; e += kLanes) {
      const __m512 v = Widen(value + e);
      for (int64_t g = 0; g < groups; ++g) {
        float* o = out + g * h + e;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(v, _mm512_set1_ps(p[g]), _mm512_loadu_ps(o)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t e = 0; e < h; ++e) out[g * h + e] += p[g] * Bf16ToF32(value[e]);
  }
}

// One row b and KV head kv: its `groups` query heads from `first_head`, over keys [lo, hi].
struct Head {
  const uint16_t* query;  // [groups, H] of this row
  const uint16_t* key;    // [S, K, H] of this row, at head kv
  const uint16_t* value;
  uint16_t* out;  // [groups, H]
  int64_t groups, h, kv_stride;  // kv_stride: K * H, from one key row to the next
};

void AttendOne(const Head& t, int64_t lo, int64_t hi, float softcap, std::vector<float>& q,
               std::vector<float>& logits, std::vector<float>& acc) {
  const int64_t length = hi - lo + 1, g = t.groups, h = t.h;
  q.resize(g * h);
  for (int64_t e = 0; e < g * h; ++e) q[e] = Bf16ToF32(t.query[e]);
  logits.resize(length * g);  // [L, G]
  for (int64_t s = 0; s < length; ++s) {
    float* row = logits.data() + s * g;
    Dots(q.data(), g, t.key + (lo + s) * t.kv_stride, h, row);
    for (int64_t i = 0; i < g; ++i) {
      float logit = RoundBf16(row[i]);
      if (softcap > 0.0f) logit = RoundBf16(std::tanh(logit / softcap) * softcap);
      row[i] = logit;
    }
  }
  float top[kMaxGroup], sum[kMaxGroup];
  for (int64_t i = 0; i < g; ++i) top[i] = -INFINITY, sum[i] = 0.0f;
  for (int64_t s = 0; s < length; ++s) {
    for (int64_t i = 0; i < g; ++i) top[i] = std::max(top[i], logits[s * g + i]);
  }
  for (int64_t s = 0; s < length; ++s) {
    for (int64_t i = 0; i < g; ++i) {
      const float e = std::exp(logits[s * g + i] - top[i]);
      logits[s * g + i] = e;
      sum[i] += e;
    }
  }
  acc.assign(g * h, 0.0f);
  float p[kMaxGroup];
  for (int64_t s = 0; s < length; ++s) {
    for (int64_t i = 0; i < g; ++i) p[i] = RoundBf16(logits[s * g + i] / sum[i]);
    Accumulate(p, g, t.value + (lo + s) * t.kv_stride, h, acc.data());
  }
  for (int64_t e = 0; e < g * h; ++e) t.out[e] = F32ToBf16(acc[e]);
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::BF16> query, ffi::Buffer<ffi::BF16> key,
                           ffi::Buffer<ffi::BF16> value, ffi::Buffer<ffi::S32> first,
                           ffi::Buffer<ffi::S32> last, float softcap,
                           ffi::ResultBuffer<ffi::BF16> out) {
  auto q_dims = query.dimensions();
  auto k_dims = key.dimensions();
  auto v_dims = value.dimensions();
  const bool same_kv = v_dims.size() == 4 && k_dims.size() == 4 &&
                       std::equal(k_dims.begin(), k_dims.end(), v_dims.begin());
  if (q_dims.size() != 3 || k_dims.size() != 4 || !same_kv || k_dims[0] < q_dims[0] || k_dims[3] != q_dims[2] || q_dims[1] % k_dims[2] != 0 ||
      first.element_count() != q_dims[0] || last.element_count() != q_dims[0]) {
    return ffi::Error::InvalidArgument(
        "decode_attention: want query [B, N, H], key/value [B' >= B, S, K, H] (K divides N), "
        "first and last [B]");
  }
  const int64_t b = q_dims[0], n = q_dims[1], h = q_dims[2], s = k_dims[1], k = k_dims[2];
  const int64_t group = n / k;
  if (group > kMaxGroup) {
    return ffi::Error::InvalidArgument("decode_attention: at most 8 query heads a KV head");
  }
  const auto* qs = reinterpret_cast<const uint16_t*>(query.typed_data());
  const auto* ks = reinterpret_cast<const uint16_t*>(key.typed_data());
  const auto* vs = reinterpret_cast<const uint16_t*>(value.typed_data());
  auto* os = reinterpret_cast<uint16_t*>(out->typed_data());
  std::vector<float> q, logits, acc;
  for (int64_t row = 0; row < b; ++row) {
    const int64_t lo = std::max<int64_t>(first.typed_data()[row], 0);
    const int64_t hi = std::min<int64_t>(last.typed_data()[row], s - 1);
    for (int64_t kv = 0; kv < k; ++kv) {
      const int64_t head = kv * group;
      uint16_t* o = os + (row * n + head) * h;
      if (hi < lo) {  // no visible key (not a real step): zeros, as no NaN may leave
        std::fill(o, o + group * h, uint16_t{0});
        continue;
      }
      const Head t{qs + (row * n + head) * h, ks + (row * s * k + kv) * h,
                   vs + (row * s * k + kv) * h, o, group, h, k * h};
      AttendOne(t, lo, hi, softcap, q, logits, acc);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::BF16>>());
