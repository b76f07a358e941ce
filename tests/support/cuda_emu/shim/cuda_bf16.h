// Host shim of cuda_bf16.h for the CPU emulator.
#pragma once
#include <cstring>
#include <cstdint>

#include "emu.h"

struct __nv_bfloat16 {
  unsigned short x;
  __nv_bfloat16() = default;
  operator float() const { uint32_t u = static_cast<uint32_t>(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };

inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
// Round to nearest even; every NaN becomes 0x7FFF (what cvt.rn.bf16.f32 gives).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) b.x = 0x7fffu;
  else b.x = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.x = u; return b; }

namespace emu {
template <> struct TypeCode<__nv_bfloat16> { static constexpr const char* value = "bf16"; };
template <> struct TypeCode<__nv_bfloat162> { static constexpr const char* value = "bf16"; };
}
