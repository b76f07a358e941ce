// Host shim of cuda_fp16.h for the CPU emulator (the kernels see the same names as on a GPU).
// Conversions round to nearest even with subnormals, like the hardware; f16 arithmetic is done in
// double and rounded once to f16.
#pragma once
#include <cstring>
#include <cstdint>

#include "emu.h"  // float2

struct __half {
  unsigned short x;
  __half() = default;
  __half(float f) { _Float16 h = static_cast<_Float16>(f); std::memcpy(&x, &h, 2); }
  operator float() const { _Float16 h; std::memcpy(&h, &x, 2); return static_cast<float>(h); }
};
struct alignas(4) __half2 { __half x, y; };
typedef __half half;
typedef __half2 half2;

inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __ushort_as_half(unsigned short b) { __half h; h.x = b; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __short_as_half(short b) { __half h; std::memcpy(&h.x, &b, 2); return h; }
inline short __half_as_short(__half h) { short b; std::memcpy(&b, &h.x, 2); return b; }
inline __half2 make_half2(__half a, __half b) { return __half2{a, b}; }
inline __half2 __halves2half2(__half a, __half b) { return __half2{a, b}; }
inline __half2 __half2half2(__half a) { return __half2{a, a}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return __half2{__half(a), __half(a)}; }
inline __half __low2half(__half2 v) { return v.x; }
inline __half __high2half(__half2 v) { return v.y; }
inline float __low2float(__half2 v) { return float(v.x); }
inline float __high2float(__half2 v) { return float(v.y); }

namespace emu_half {
inline __half round(double v) { return __half(static_cast<float>(static_cast<_Float16>(v))); }
}
inline __half __hadd(__half a, __half b) { return emu_half::round(double(float(a)) + float(b)); }
inline __half __hsub(__half a, __half b) { return emu_half::round(double(float(a)) - float(b)); }
inline __half __hmul(__half a, __half b) { return emu_half::round(double(float(a)) * float(b)); }
inline __half __hfma(__half a, __half b, __half c) { return emu_half::round(double(float(a)) * float(b) + float(c)); }
inline __half2 __hadd2(__half2 a, __half2 b) { return __half2{__hadd(a.x, b.x), __hadd(a.y, b.y)}; }
inline __half2 __hsub2(__half2 a, __half2 b) { return __half2{__hsub(a.x, b.x), __hsub(a.y, b.y)}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return __half2{__hmul(a.x, b.x), __hmul(a.y, b.y)}; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }
inline bool __hisnan(__half a) { return (a.x & 0x7FFF) > 0x7C00; }
inline int __hisinf(__half a) { return (a.x & 0x7FFF) == 0x7C00 ? ((a.x & 0x8000) ? -1 : 1) : 0; }

inline float2 __half22float2(__half2 v) { return float2{float(v.x), float(v.y)}; }
inline __half2 __float22half2_rn(float2 v) { return __half2{__half(v.x), __half(v.y)}; }

namespace emu {  // kernel signatures name f16 parameters, so the launcher can check array dtypes
template <> struct TypeCode<__half> { static constexpr const char* value = "f16"; };
template <> struct TypeCode<__half2> { static constexpr const char* value = "f16"; };
}
