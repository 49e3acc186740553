// bf16 <-> f32 for the native kernels (a bf16 is the high half of an f32).
#ifndef EQUARX_SERVE_KERNELS_BF16_H_
#define EQUARX_SERVE_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

namespace equarx {

inline float Bf16ToF32(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest, ties to even, as XLA converts f32 to bf16 (a NaN stays a quiet NaN).
inline uint16_t F32ToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace equarx

#endif  // EQUARX_SERVE_KERNELS_BF16_H_
