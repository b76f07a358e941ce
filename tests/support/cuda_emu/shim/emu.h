// CUDA-on-CPU emulator: the execution model and the device intrinsics our kernels use.
//
// Every CUDA thread of a block runs as a cooperative coroutine (a "fiber" with its own stack) on one OS
// thread; blocks run one after another. A fiber runs until it reaches a collective (__syncthreads, a
// warp shuffle/ballot/__syncwarp, an mma.sync) and then yields; once every live thread the collective
// involves is waiting, the scheduler computes the result and resumes them. Plain code between
// collectives therefore runs in some sequential order, which is a legal CUDA schedule; atomics are
// plain read-modify-writes (nothing runs concurrently).
//
// Checks that a GPU would only show as wrong answers or hangs: __syncthreads reached by some threads
// while others exit or wait elsewhere (deadlock), warp collectives whose lanes disagree on the
// operation, shuffles that read an exited lane, cp.async data read before cp.async.wait_group (copies
// land at the wait, not at the issue, so a missing wait shows stale shared memory), dynamic shared
// memory is filled with NaN bytes (0xFF) at every block start.
//
// Numerics: float ops are IEEE (build with -ffp-contract=off so a*b+c stays two roundings, like the
// __f*_rn intrinsics); nvcc/NVRTC contract a*b+c to fma by default, so plain float expressions may
// differ in the last bit from a GPU. f16 values round like the hardware. mma.sync accumulates the 16
// exact f16 products in double and rounds once to f32 (tensor cores may truncate differently).
#pragma once

#define CUPYLLM_EMULATOR 1

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// ---- CUDA keywords -------------------------------------------------------------------------------
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))  // GCC takes it anywhere in the decl-specifiers, as nvcc does
// Static __shared__ variables the build script does not rewrite (static_shared below) are block-scope statics: shared by every thread of the block (blocks
// run one at a time). `extern __shared__` (dynamic shared memory) is rewritten by the build script to
// a plain `extern` array that the generated wrapper defines (see emulator.py).
#define __shared__ static
#define __constant__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned x, y, z; };

namespace emu {

// ---- runtime state (defined in the runtime translation unit, EMU_RUNTIME_IMPL) --------------------
enum class Wait : int { kNone = 0, kBlock, kWarp, kDone };
enum class WarpOp : int { kNone = 0, kShfl, kBallot, kSync, kMma, kLdmatrix };

struct Fiber {
  void* sp = nullptr;          // saved stack pointer while switched out
  void* stack = nullptr;       // mmap'ed stack (guard page below)
  size_t stack_bytes = 0;
  uint3 tid{0, 0, 0};
  int linear = 0, warp = 0, lane = 0;
  Wait wait = Wait::kNone;
  // warp collective in flight
  WarpOp op = WarpOp::kNone;
  unsigned mask = 0;
  int src = 0;                 // shuffle source lane
  uint64_t in[10] = {};        // operands (shuffle value / predicate / mma fragments)
  uint64_t out[4] = {};        // results
  // block collective in flight (__syncthreads_count/and/or)
  int pred = 0;
  int block_result = 0;
  // cp.async copies not yet landed
  struct Copy { void* dst; const void* src; unsigned bytes, src_bytes; long group; };
  Copy* copies = nullptr;
  int n_copies = 0, cap_copies = 0;
  long open_group = 0;         // group id that the next commit closes
};

extern Fiber* g_cur;           // the running fiber
extern uint3 g_block_idx;
extern dim3 g_block_dim, g_grid_dim;

void yield_wait(Wait why);     // switch back to the scheduler
void fail(const char* fmt, ...);  // record an error and abandon the launch (does not return)

// A launch: `thread_body(ctx)` runs once per CUDA thread. Returns 0, or -1 with last_error() set.
int launch(void (*thread_body)(void*), void* ctx, dim3 grid, dim3 block, size_t dynamic_smem);
const char* last_error();

// Dynamic shared memory of the running block: `extern __shared__ T name[];` in a kernel is rewritten
// by the build script to `T* const name = reinterpret_cast<T*>(::emu::dynamic_smem());`.
constexpr size_t kDynamicSmemCapacity = 232448;  // sm_90's opt-in maximum (227 KB)
unsigned char* dynamic_smem();
size_t dynamic_smem_size();  // bytes requested by the running launch

// Static shared memory of the running block: the build script rewrites `__shared__ T name[..];` to
// `static SharedSlot slot; T (&name)[..] = static_shared<T[..]>(slot);`. The first thread of a block to reach the
// declaration places it in the block's static shared memory (16-byte aligned, at most 48 KB, and with the dynamic
// request at most the 227 KB an SM gives a block) and fills it with 0xFF; the block's other threads get the same
// address. So a read before any write sees NaN / -1 bits, as a GPU would show garbage, not the previous block's.
constexpr size_t kStaticSmemCapacity = 49152;
struct SharedSlot {
  unsigned long long block = 0;  // the block (emulator-wide count) that placed it; 0: none yet
  unsigned char* address = nullptr;
};
unsigned char* static_shared(SharedSlot& slot, size_t bytes);
template <class T>
inline T& static_shared(SharedSlot& slot) {
  return *reinterpret_cast<T*>(static_shared(slot, sizeof(T)));
}

// First in every kernel with __launch_bounds__ (the build script puts it there): a block of more threads than the
// kernel was compiled for is refused on a GPU ("too many resources requested for launch").
inline void check_launch_bounds(long max_threads) {
  const long n_threads = long(g_block_dim.x) * g_block_dim.y * g_block_dim.z;
  if (n_threads > max_threads)
    fail("a block of %ld threads exceeds the kernel's __launch_bounds__(%ld)", n_threads, max_threads);
}

// cp.async (deferred: the copy lands at the wait that covers it)
void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes);
void cp_async_commit();
void cp_async_wait(int n_pending_allowed);

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
void mma_m16n8k16_f16_f32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]);

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives row l % 8 of matrix l / 8 (16-byte aligned)
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);

// ---- warp collectives --------------------------------------------------------------------------------
inline uint64_t shfl_bits(unsigned mask, uint64_t bits, int src_lane) {
  Fiber* f = g_cur;
  f->op = WarpOp::kShfl;
  f->mask = mask;
  f->src = src_lane;
  f->in[0] = bits;
  yield_wait(Wait::kWarp);
  return f->out[0];
}

template <class T>
inline T shfl(unsigned mask, T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  b = shfl_bits(mask, b, src_lane);
  T r;
  std::memcpy(&r, &b, sizeof(T));
  return r;
}

inline unsigned ballot(unsigned mask, int pred) {
  Fiber* f = g_cur;
  f->op = WarpOp::kBallot;
  f->mask = mask;
  f->in[0] = pred != 0;
  yield_wait(Wait::kWarp);
  return static_cast<unsigned>(f->out[0]);
}

inline int block_sync_pred(int pred) {  // returns the number of threads with pred != 0
  g_cur->pred = pred != 0;
  yield_wait(Wait::kBlock);
  return g_cur->block_result;
}

inline int lane_id() { return g_cur->lane; }

}  // namespace emu

// ---- built-in variables --------------------------------------------------------------------------
#define threadIdx (::emu::g_cur->tid)
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
constexpr int warpSize = 32;

// ---- synchronisation ------------------------------------------------------------------------------
inline void __syncthreads() { emu::block_sync_pred(0); }
inline int __syncthreads_count(int p) { return emu::block_sync_pred(p); }
inline int __syncthreads_or(int p) { return emu::block_sync_pred(p) != 0; }
inline int __syncthreads_and(int p) {
  return emu::block_sync_pred(p) == static_cast<int>(emu::g_block_dim.x * emu::g_block_dim.y * emu::g_block_dim.z);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::Fiber* f = emu::g_cur;
  f->op = emu::WarpOp::kSync;
  f->mask = mask;
  emu::yield_wait(emu::Wait::kWarp);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline unsigned __activemask() { return emu::ballot(0xffffffffu, 1); }
inline void __trap() { emu::fail("__trap() called"); }

// Shuffles: source lane per the CUDA definition; `width` splits the warp into segments.
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = emu::lane_id();
  const int base = lane & ~(width - 1);
  return emu::shfl(mask, v, base + (src & (width - 1)));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = emu::lane_id();
  const int base = lane & ~(width - 1);
  const int s = lane - static_cast<int>(delta);
  return emu::shfl(mask, v, s < base ? lane : s);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = emu::lane_id();
  const int base = lane & ~(width - 1);
  const int s = lane + static_cast<int>(delta);
  return emu::shfl(mask, v, s >= base + width ? lane : s);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = emu::lane_id();
  const int base = lane & ~(width - 1);
  const int s = lane ^ lane_mask;
  return emu::shfl(mask, v, (s < base || s >= base + width) ? lane : s);
}
inline unsigned __ballot_sync(unsigned mask, int p) { return emu::ballot(mask, p); }
inline int __any_sync(unsigned mask, int p) { return emu::ballot(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return emu::ballot(mask, p) == emu::ballot(mask, 1); }

// ---- atomics (no concurrency in the emulator: plain read-modify-write) ------------------------------
// The value converts to the pointee type, as CUDA's overloads (atomicAdd(int*, int), ...) would.
template <class T, class U> inline T atomicAdd(T* p, U v) { T old = *p; *p = old + T(v); return old; }
template <class T, class U> inline T atomicSub(T* p, U v) { T old = *p; *p = old - T(v); return old; }
template <class T, class U> inline T atomicMax(T* p, U v) { T old = *p; *p = old > T(v) ? old : T(v); return old; }
template <class T, class U> inline T atomicMin(T* p, U v) { T old = *p; *p = old < T(v) ? old : T(v); return old; }
template <class T, class U> inline T atomicExch(T* p, U v) { T old = *p; *p = T(v); return old; }
template <class T, class U> inline T atomicOr(T* p, U v) { T old = *p; *p = old | T(v); return old; }
template <class T, class U> inline T atomicAnd(T* p, U v) { T old = *p; *p = old & T(v); return old; }
template <class T, class U, class V> inline T atomicCAS(T* p, U cmp, V v) {
  T old = *p;
  if (old == T(cmp)) *p = T(v);
  return old;
}

// ---- vector types ------------------------------------------------------------------------------------
#define EMU_VEC2(T, N, A) struct alignas(A) N { T x, y; }; \
  inline N make_##N(T x, T y) { return N{x, y}; }
#define EMU_VEC4(T, N, A) struct alignas(A) N { T x, y, z, w; }; \
  inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
EMU_VEC2(float, float2, 8)
EMU_VEC4(float, float4, 16)
EMU_VEC2(int, int2, 8)
EMU_VEC4(int, int4, 16)
EMU_VEC2(unsigned, uint2, 8)
EMU_VEC4(unsigned, uint4, 16)
EMU_VEC2(unsigned short, ushort2, 4)
EMU_VEC4(unsigned char, uchar4, 4)
EMU_VEC4(signed char, char4, 4)
EMU_VEC2(double, double2, 16)
#undef EMU_VEC2
#undef EMU_VEC4
struct float3 { float x, y, z; };
inline float3 make_float3(float x, float y, float z) { return float3{x, y, z}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }

// ---- math ---------------------------------------------------------------------------------------------
// CUDA's overloaded min/max for the arithmetic types (mixed signed/unsigned ints follow CUDA's
// "unsigned wins" rule via the common type).
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return C(a) < C(b) ? C(a) : C(b); }
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return C(a) > C(b) ? C(a) : C(b); }
// expf, logf, tanhf, fmaxf, ... come from <math.h> (global namespace), as in CUDA.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __frsqrt_rn(float a) { return 1.0f / std::sqrt(a); }
inline float __fdividef(float a, float b) { return a / b; }
// The fast-math intrinsics are approximations on the GPU (ex2.approx, lg2.approx); here they are exact.
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int __float2int_rz(float a) { return static_cast<int>(a); }
inline int __float2int_rn(float a) { return static_cast<int>(std::nearbyint(a)); }
inline int __float2int_rd(float a) { return static_cast<int>(std::floor(a)); }
inline int __float2int_ru(float a) { return static_cast<int>(std::ceil(a)); }
inline float __int2float_rn(int a) { return static_cast<float>(a); }
inline float __uint2float_rn(unsigned a) { return static_cast<float>(a); }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
// DPX (one instruction on sm_90, emulated before it): min(a + b, c), the sum wrapping as in 32-bit hardware
inline int __viaddmin_s32(int a, int b, int c) {
  const int sum = static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
  return sum < c ? sum : c;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (shift & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift & 31));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }

// ---- kernel table: generic argument unpacking -------------------------------------------------------
// A kernel `void k(A0, A1, ...)` is launched from an array of pointers to its argument values (as
// cuLaunchKernel takes them); `signature_of` describes the parameter types to the Python side, which
// checks and packs the arguments.
namespace emu {

template <class T> struct TypeCode { static constexpr const char* value = "raw"; };
#define EMU_TYPE_CODE(T, code) template <> struct TypeCode<T> { static constexpr const char* value = code; };
EMU_TYPE_CODE(float, "f32")
EMU_TYPE_CODE(double, "f64")
EMU_TYPE_CODE(signed char, "i8")
EMU_TYPE_CODE(char, "i8")
EMU_TYPE_CODE(unsigned char, "u8")
EMU_TYPE_CODE(short, "i16")
EMU_TYPE_CODE(unsigned short, "u16")
EMU_TYPE_CODE(int, "i32")
EMU_TYPE_CODE(unsigned, "u32")
EMU_TYPE_CODE(long, "i64")
EMU_TYPE_CODE(long long, "i64")
EMU_TYPE_CODE(unsigned long, "u64")
EMU_TYPE_CODE(unsigned long long, "u64")
EMU_TYPE_CODE(bool, "b8")
EMU_TYPE_CODE(void, "void")
EMU_TYPE_CODE(float2, "f32")
EMU_TYPE_CODE(float4, "f32")
#undef EMU_TYPE_CODE

template <class T> const char* type_code() { return TypeCode<std::remove_cv_t<T>>::value; }

template <class T> std::string param_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) {
    return std::string("p:") + type_code<std::remove_pointer_t<U>>();
  } else {
    return std::string("v:") + type_code<U>() + ":" + std::to_string(sizeof(U));
  }
}

template <class... A> std::string signature_of(void (*)(A...)) {
  std::string s;
  ((s += param_code<A>() + ","), ...);
  if (!s.empty()) s.pop_back();
  return s;
}

template <class... A, size_t... I>
void call_unpacked(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// Calls `fn` with its arguments read from args[i] (each a pointer to a value of parameter i's type).
template <class... A>
void call(void (*fn)(A...), void** args) { call_unpacked(fn, args, std::index_sequence_for<A...>{}); }

template <class... A>
int launch_kernel(void (*fn)(A...), void** args, dim3 grid, dim3 block, size_t dynamic_smem) {
  struct Ctx { void (*fn)(A...); void** args; } ctx{fn, args};
  return launch([](void* c) { auto* x = static_cast<Ctx*>(c); call(x->fn, x->args); }, &ctx, grid, block,
                dynamic_smem);
}

typedef int (*LaunchFn)(void** args, dim3 grid, dim3 block, size_t dynamic_smem);
void register_kernel(const char* name, const std::string& signature, LaunchFn launch);

template <auto Fn>
int launch_entry(void** args, dim3 grid, dim3 block, size_t dynamic_smem) {
  return launch_kernel(Fn, args, grid, block, dynamic_smem);
}

template <auto Fn>
struct Registration {
  explicit Registration(const char* name) { register_kernel(name, signature_of(Fn), &launch_entry<Fn>); }
};

}  // namespace emu
