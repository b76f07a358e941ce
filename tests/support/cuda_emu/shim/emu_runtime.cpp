// The emulator's scheduler: fibers (one per CUDA thread), block/warp collectives, cp.async, mma.sync.
// Compiled once into every emulated kernel library (see emulator.py); the model is described in emu.h.
#include "emu.h"

#include <cstdarg>
#include <cstdlib>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace emu {

Fiber* g_cur = nullptr;
uint3 g_block_idx{0, 0, 0};
dim3 g_block_dim, g_grid_dim;

namespace {

std::string g_error;
bool g_abort = false;
void (*g_body)(void*) = nullptr;
void* g_body_ctx = nullptr;
std::vector<Fiber> g_fibers;

size_t stack_bytes() {
  const char* env = std::getenv("EMU_STACK_KB");
  const long kb = env ? std::atol(env) : 256;
  return static_cast<size_t>(kb > 16 ? kb : 16) * 1024;
}

void* map_stack(size_t bytes) {  // stack with a PROT_NONE guard page below it (overflow -> SIGSEGV)
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, page, PROT_NONE);
  return static_cast<char*>(p) + page;
}

[[noreturn]] void fiber_main(Fiber* f);

// ---- context switch ---------------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void emu_fiber_trampoline();
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the
// stack pointer to *save_sp, loads load_sp and restores the same frame from there.
asm(R"(
    .text
    .p2align 4
    .globl emu_ctx_switch
    .hidden emu_ctx_switch
    .type emu_ctx_switch, @function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 0(%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 0(%rsp)
    fldcw 4(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch

    .p2align 4
    .globl emu_fiber_trampoline
    .hidden emu_fiber_trampoline
    .type emu_fiber_trampoline, @function
emu_fiber_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_fiber_trampoline, .-emu_fiber_trampoline
)");

void* g_sched_sp = nullptr;

void init_context(Fiber* f) {
  char* top = static_cast<char*>(f->stack) + f->stack_bytes;
  top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 88);  // after `ret` rsp = top - 16: 16-byte aligned
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&sp[0], csr, 8);
  sp[1] = 0;
  sp[2] = 0;                                            // r15
  sp[3] = 0;                                            // r14
  sp[4] = reinterpret_cast<uint64_t>(&fiber_main);      // r13: entry
  sp[5] = reinterpret_cast<uint64_t>(f);                // r12: its argument
  sp[6] = 0;                                            // rbx
  sp[7] = 0;                                            // rbp
  sp[8] = reinterpret_cast<uint64_t>(&emu_fiber_trampoline);
  f->sp = sp;
}
void switch_to(Fiber* f) { g_cur = f; emu_ctx_switch(&g_sched_sp, f->sp); g_cur = nullptr; }
void switch_to_scheduler(Fiber* f) { emu_ctx_switch(&f->sp, g_sched_sp); }
#else
ucontext_t g_sched_ctx;
std::vector<ucontext_t> g_ctx;
void ucontext_entry(unsigned hi, unsigned lo) {
  fiber_main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
void init_context(Fiber* f) {
  ucontext_t* c = &g_ctx[f - g_fibers.data()];
  getcontext(c);
  c->uc_stack.ss_sp = f->stack;
  c->uc_stack.ss_size = f->stack_bytes;
  c->uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(c, reinterpret_cast<void (*)()>(&ucontext_entry), 2, unsigned(p >> 32), unsigned(p));
}
void switch_to(Fiber* f) { g_cur = f; swapcontext(&g_sched_ctx, &g_ctx[f - g_fibers.data()]); g_cur = nullptr; }
void switch_to_scheduler(Fiber* f) { swapcontext(&g_ctx[f - g_fibers.data()], &g_sched_ctx); }
#endif

void land_copies(Fiber* f, long below_group) {  // perform pending cp.async copies of groups < below_group
  int kept = 0;
  for (int i = 0; i < f->n_copies; ++i) {
    Fiber::Copy& c = f->copies[i];
    if (c.group < below_group) {
      std::memcpy(c.dst, c.src, c.src_bytes);
      std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
    } else {
      f->copies[kept++] = c;
    }
  }
  f->n_copies = kept;
}

[[noreturn]] void fiber_main(Fiber* f) {
  g_body(g_body_ctx);
  f->n_copies = 0;  // copies never waited for: on a GPU nobody could read them either
  f->wait = Wait::kDone;
  switch_to_scheduler(f);
  std::abort();  // a finished fiber is never resumed
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShfl: return "shuffle";
    case WarpOp::kBallot: return "ballot/any/all";
    case WarpOp::kSync: return "__syncwarp";
    case WarpOp::kMma: return "mma.sync";
    case WarpOp::kLdmatrix: return "ldmatrix";
    default: return "?";
  }
}

float half_bits_to_float(uint32_t bits) {
  _Float16 h;
  const uint16_t b = static_cast<uint16_t>(bits);
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

void resolve_mma(Fiber* lanes[32]) {
  double a[16][16], b[16][8], c[16][8];
  for (int l = 0; l < 32; ++l) {
    const Fiber* f = lanes[l];
    const int g = l >> 2, t = l & 3;
    auto lo = [&](int i) { return double(half_bits_to_float(static_cast<uint32_t>(f->in[i]) & 0xFFFFu)); };
    auto hi = [&](int i) { return double(half_bits_to_float(static_cast<uint32_t>(f->in[i]) >> 16)); };
    a[g][2 * t] = lo(0);         a[g][2 * t + 1] = hi(0);
    a[g + 8][2 * t] = lo(1);     a[g + 8][2 * t + 1] = hi(1);
    a[g][2 * t + 8] = lo(2);     a[g][2 * t + 9] = hi(2);
    a[g + 8][2 * t + 8] = lo(3); a[g + 8][2 * t + 9] = hi(3);
    b[2 * t][g] = lo(4);         b[2 * t + 1][g] = hi(4);
    b[2 * t + 8][g] = lo(5);     b[2 * t + 9][g] = hi(5);
    float cf[4];
    for (int i = 0; i < 4; ++i) { const uint32_t u = static_cast<uint32_t>(f->in[6 + i]); std::memcpy(&cf[i], &u, 4); }
    c[g][2 * t] = cf[0]; c[g][2 * t + 1] = cf[1]; c[g + 8][2 * t] = cf[2]; c[g + 8][2 * t + 1] = cf[3];
  }
  for (int l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    const int g = l >> 2, t = l & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
      double s = c[rows[i]][cols[i]];
      for (int k = 0; k < 16; ++k) s += a[rows[i]][k] * b[k][cols[i]];
      const float d = static_cast<float>(s);
      uint32_t u;
      std::memcpy(&u, &d, 4);
      f->out[i] = u;
    }
  }
}

// ldmatrix .x4: in[0] = the row address lane l gives (row l % 8 of matrix l / 8), in[1] = trans. The rows
// are read here, when every lane has arrived (all earlier shared-memory stores of the warp are done).
bool resolve_ldmatrix(Fiber* lanes[32], int w) {
  uint16_t m[4][8][8];  // [matrix][row][column]
  const bool trans = lanes[0]->in[1] != 0;
  for (int l = 0; l < 32; ++l) {
    const uintptr_t address = static_cast<uintptr_t>(lanes[l]->in[0]);
    if (address % 16 != 0) {
      fail("warp %d lane %d: ldmatrix row address %p is not 16-byte aligned", w, l, reinterpret_cast<void*>(address));
      return false;
    }
    if ((lanes[l]->in[1] != 0) != trans) {
      fail("warp %d: lanes disagree on ldmatrix .trans", w);
      return false;
    }
    std::memcpy(m[l / 8][l % 8], reinterpret_cast<const void*>(address), 16);
  }
  for (int l = 0; l < 32; ++l) {
    const int row = l / 4, pair = 2 * (l % 4);
    for (int k = 0; k < 4; ++k) {
      const uint16_t lo = trans ? m[k][pair][row] : m[k][row][pair];
      const uint16_t hi = trans ? m[k][pair + 1][row] : m[k][row][pair + 1];
      lanes[l]->out[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  return true;
}

// Completes the collective of warp `w` if every live lane is waiting at one. Returns true on progress.
bool try_resolve_warp(int w, int n_threads) {
  Fiber* lanes[32] = {};
  int n_live = 0, n_waiting = 0;
  WarpOp op = WarpOp::kNone;
  for (int l = 0; l < 32; ++l) {
    const int t = w * 32 + l;
    if (t >= n_threads) continue;
    Fiber* f = &g_fibers[t];
    if (f->wait == Wait::kDone) continue;
    ++n_live;
    if (f->wait != Wait::kWarp) continue;
    ++n_waiting;
    if (op == WarpOp::kNone) {
      op = f->op;
    } else if (f->op != op) {
      fail("warp %d: lanes wait at different warp collectives (%s and %s): divergent code around a "
           "collective", w, op_name(op), op_name(f->op));
      return false;
    }
    lanes[l] = f;
  }
  if (n_waiting == 0 || n_waiting != n_live) return false;
  switch (op) {
    case WarpOp::kSync:
      break;
    case WarpOp::kBallot: {
      uint64_t bits = 0;
      for (int l = 0; l < 32; ++l)
        if (lanes[l] && lanes[l]->in[0]) bits |= uint64_t(1) << l;
      for (int l = 0; l < 32; ++l)
        if (lanes[l]) lanes[l]->out[0] = bits & lanes[l]->mask;
      break;
    }
    case WarpOp::kShfl:
      for (int l = 0; l < 32; ++l) {
        if (!lanes[l]) continue;
        const int s = lanes[l]->src;
        if (s < 0 || s >= 32 || !lanes[s]) {
          fail("warp %d lane %d: shuffle reads lane %d, which has exited or does not exist", w, l, s);
          return false;
        }
        lanes[l]->out[0] = lanes[s]->in[0];
      }
      break;
    case WarpOp::kMma:
      for (int l = 0; l < 32; ++l) {
        if (!lanes[l]) {
          fail("warp %d: mma.sync needs all 32 lanes, lane %d has exited or does not exist", w, l);
          return false;
        }
      }
      resolve_mma(lanes);
      break;
    case WarpOp::kLdmatrix:
      for (int l = 0; l < 32; ++l) {
        if (!lanes[l]) {
          fail("warp %d: ldmatrix needs all 32 lanes, lane %d has exited or does not exist", w, l);
          return false;
        }
      }
      if (!resolve_ldmatrix(lanes, w)) return false;
      break;
    default:
      fail("warp %d: unknown collective", w);
      return false;
  }
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) { lanes[l]->wait = Wait::kNone; lanes[l]->op = WarpOp::kNone; }
  return true;
}

std::string describe_waits(int n_threads) {
  std::string s;
  int shown = 0;
  for (int t = 0; t < n_threads && shown < 8; ++t) {
    const Fiber& f = g_fibers[t];
    if (f.wait == Wait::kDone) continue;
    char buf[96];
    std::snprintf(buf, sizeof buf, " thread %d: %s;", t,
                  f.wait == Wait::kBlock ? "__syncthreads" : op_name(f.op));
    s += buf;
    ++shown;
  }
  return s;
}

// EMU_ORDER=reverse runs a launch's blocks, and a block's threads between collectives, from the last to the first.
// Code between two barriers may run in any order on a GPU, and blocks in any order; here they run one after
// another, so a read of memory that another thread writes without a barrier in between (or another block, with no
// ordering at all) sees the write in one order and misses it in the other: a test that passes in both orders has
// no such race between threads or blocks of lower and higher index.
bool in_reverse() {
  const char* env = std::getenv("EMU_ORDER");
  return env && std::strcmp(env, "reverse") == 0;
}

int run_block(int n_threads, bool reverse) {
  for (int t = 0; t < n_threads; ++t) {
    Fiber& f = g_fibers[t];
    f.tid = uint3{t % g_block_dim.x, (t / g_block_dim.x) % g_block_dim.y, t / (g_block_dim.x * g_block_dim.y)};
    f.linear = t;
    f.warp = t / 32;
    f.lane = t % 32;
    f.wait = Wait::kNone;
    f.op = WarpOp::kNone;
    f.n_copies = 0;
    f.open_group = 0;
    init_context(&f);
  }
  const int n_warps = (n_threads + 31) / 32;
  for (;;) {
    for (int i = 0; i < n_threads; ++i) {
      const int t = reverse ? n_threads - 1 - i : i;
      if (g_fibers[t].wait == Wait::kNone) {
        switch_to(&g_fibers[t]);
        if (g_abort) return -1;
      }
    }
    int n_live = 0, n_block = 0;
    for (int t = 0; t < n_threads; ++t) {
      if (g_fibers[t].wait != Wait::kDone) ++n_live;
      if (g_fibers[t].wait == Wait::kBlock) ++n_block;
    }
    if (n_live == 0) return 0;
    bool progress = false;
    for (int w = 0; w < n_warps; ++w) {
      progress |= try_resolve_warp(w, n_threads);
      if (g_abort) return -1;
    }
    if (progress) continue;
    if (n_block == n_live) {  // __syncthreads: exited threads count as arrived (sm_70+ behaviour)
      int count = 0;
      for (int t = 0; t < n_threads; ++t)
        if (g_fibers[t].wait == Wait::kBlock) count += g_fibers[t].pred;
      for (int t = 0; t < n_threads; ++t)
        if (g_fibers[t].wait == Wait::kBlock) { g_fibers[t].wait = Wait::kNone; g_fibers[t].block_result = count; }
      continue;
    }
    fail("deadlock: no collective can complete (a __syncthreads or warp collective in divergent code?);%s",
         describe_waits(n_threads).c_str());
    return -1;
  }
}

}  // namespace

void yield_wait(Wait why) {
  Fiber* f = g_cur;
  f->wait = why;
  switch_to_scheduler(f);
}

void fail(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (!g_abort) g_error = buf;
  g_abort = true;
  if (g_cur) {  // inside a fiber: abandon it (its stack is reused by the next launch)
    Fiber* f = g_cur;
    for (;;) { f->wait = Wait::kDone; switch_to_scheduler(f); }
  }
}

const char* last_error() { return g_error.c_str(); }

unsigned char* dynamic_smem();
void begin_block_static_smem();
namespace { size_t g_dynamic_smem_bytes = 0; }
size_t dynamic_smem_size() { return g_dynamic_smem_bytes; }

int launch(void (*thread_body)(void*), void* ctx, dim3 grid, dim3 block, size_t dynamic_smem_bytes) {
  g_error.clear();
  g_abort = false;
  const long n_threads = long(block.x) * block.y * block.z;
  if (n_threads < 1 || n_threads > 1024 || block.z > 64) {
    g_error = "invalid block shape: at most 1024 threads and blockDim.z <= 64";
    return -1;
  }
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
    g_error = "invalid grid shape: gridDim.y and gridDim.z must be 1..65535";
    return -1;
  }
  if (dynamic_smem_bytes > kDynamicSmemCapacity) {
    g_error = "dynamic shared memory request exceeds 227 KB (sm_90's maximum)";
    return -1;
  }
  const size_t stack = stack_bytes();
  if (g_fibers.size() < size_t(n_threads)) {
#if !defined(__x86_64__)
    g_ctx.resize(n_threads);
#endif
    g_fibers.resize(n_threads);
  }
  for (long t = 0; t < n_threads; ++t) {
    Fiber& f = g_fibers[t];
    if (!f.stack || f.stack_bytes != stack) {
      f.stack = map_stack(stack);
      f.stack_bytes = stack;
      if (!f.stack) { g_error = "could not map a fiber stack"; return -1; }
    }
  }
  g_dynamic_smem_bytes = dynamic_smem_bytes;
  g_body = thread_body;
  g_body_ctx = ctx;
  g_block_dim = block;
  g_grid_dim = grid;
  const bool reverse = in_reverse();
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        const unsigned x = reverse ? grid.x - 1 - bx : bx, y = reverse ? grid.y - 1 - by : by,
                       z = reverse ? grid.z - 1 - bz : bz;
        g_block_idx = uint3{x, y, z};
        begin_block_static_smem();
        if (dynamic_smem_bytes)  // NaN bytes, also a little past the request: uninitialised reads show
          std::memset(dynamic_smem(), 0xFF, std::min(kDynamicSmemCapacity, dynamic_smem_bytes + 4096));
        if (run_block(int(n_threads), reverse) != 0) {
          char where[96];
          std::snprintf(where, sizeof where, " [block (%u, %u, %u)]", x, y, z);
          g_error += where;
          return -1;
        }
      }
  return 0;
}

void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
  Fiber* f = g_cur;
  if (src_bytes > bytes) fail("cp.async: src-size %u exceeds cp-size %u", src_bytes, bytes);
  if (reinterpret_cast<uintptr_t>(dst) % bytes || (src_bytes && reinterpret_cast<uintptr_t>(src) % bytes))
    fail("cp.async of %u bytes needs %u-byte aligned addresses (dst %p, src %p)", bytes, bytes, dst, src);
  if (f->n_copies == f->cap_copies) {
    f->cap_copies = f->cap_copies ? 2 * f->cap_copies : 64;
    f->copies = static_cast<Fiber::Copy*>(std::realloc(f->copies, f->cap_copies * sizeof(Fiber::Copy)));
  }
  f->copies[f->n_copies++] = Fiber::Copy{dst, src, bytes, src_bytes, f->open_group};
}

void cp_async_commit() { ++g_cur->open_group; }

void cp_async_wait(int n_pending_allowed) { land_copies(g_cur, g_cur->open_group - n_pending_allowed); }

void mma_m16n8k16_f16_f32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  Fiber* f = g_cur;
  for (int i = 0; i < 4; ++i) f->in[i] = a[i];
  f->in[4] = b[0];
  f->in[5] = b[1];
  for (int i = 0; i < 4; ++i) { uint32_t u; std::memcpy(&u, &c[i], 4); f->in[6 + i] = u; }
  f->op = WarpOp::kMma;
  f->mask = 0xffffffffu;
  yield_wait(Wait::kWarp);
  for (int i = 0; i < 4; ++i) { const uint32_t u = static_cast<uint32_t>(f->out[i]); std::memcpy(&d[i], &u, 4); }
}

void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  Fiber* f = g_cur;
  f->in[0] = reinterpret_cast<uintptr_t>(row);
  f->in[1] = trans ? 1 : 0;
  f->op = WarpOp::kLdmatrix;
  f->mask = 0xffffffffu;
  yield_wait(Wait::kWarp);
  for (int i = 0; i < 4; ++i) r[i] = static_cast<uint32_t>(f->out[i]);
}

}  // namespace emu

// ---- kernel registry and the C API the Python side calls ----------------------------------------------
namespace emu {
namespace {
struct Entry { std::string name, signature; LaunchFn launch; };
std::vector<Entry>& entries() { static std::vector<Entry> e; return e; }
alignas(128) unsigned char g_dynamic_smem[kDynamicSmemCapacity];
}  // namespace

unsigned char* dynamic_smem() { return g_dynamic_smem; }

namespace {
alignas(128) unsigned char g_static_smem[kStaticSmemCapacity];
unsigned long long g_block_serial = 0;  // counts every block run; SharedSlot::block names the one that placed it
size_t g_static_smem_top = 0;          // bytes of g_static_smem placed by the running block
}  // namespace

void begin_block_static_smem() {
  ++g_block_serial;
  g_static_smem_top = 0;
}

unsigned char* static_shared(SharedSlot& slot, size_t bytes) {
  if (slot.block == g_block_serial) return slot.address;
  if (!g_cur) fail("a __shared__ variable used outside a kernel (at namespace scope?)");
  const size_t offset = (g_static_smem_top + 15) / 16 * 16;
  if (offset + bytes > kStaticSmemCapacity)
    fail("static shared memory of %zu bytes exceeds 48 KB", offset + bytes);
  if (offset + bytes + dynamic_smem_size() > kDynamicSmemCapacity)
    fail("static (%zu bytes) and dynamic (%zu bytes) shared memory exceed the 227 KB an SM gives a block",
         offset + bytes, dynamic_smem_size());
  g_static_smem_top = offset + bytes;
  std::memset(g_static_smem + offset, 0xFF, bytes);
  slot.block = g_block_serial;
  slot.address = g_static_smem + offset;
  return slot.address;
}

void register_kernel(const char* name, const std::string& signature, LaunchFn launch) {
  entries().push_back(Entry{name, signature, launch});
}
}  // namespace emu

#define EMU_API extern "C" __attribute__((visibility("default")))
EMU_API int emu_kernel_count() { return static_cast<int>(emu::entries().size()); }
EMU_API const char* emu_kernel_name(int i) { return emu::entries()[i].name.c_str(); }
EMU_API const char* emu_kernel_signature(int i) { return emu::entries()[i].signature.c_str(); }
EMU_API const char* emu_last_error() { return emu::last_error(); }
EMU_API int emu_kernel_launch(int i, void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned long long dynamic_smem) {
  return emu::entries()[i].launch(args, dim3(gx, gy, gz), dim3(bx, by, bz), static_cast<size_t>(dynamic_smem));
}

// ---- UBSan hooks: what a GPU reports as "misaligned address" or reads past a fixed array -----------------
// Kernel units are built with -fsanitize=alignment,bounds (emulator.py SANITIZE_FLAGS) and no sanitizer
// runtime: these handlers stand in for it and fail the launch with the kernel source line. x86 tolerates a
// misaligned vector load that faults on the device; an index past a register or shared array is silent there.
namespace {
struct UbsanLocation { const char* file; uint32_t line; uint32_t column; };
struct UbsanType { uint16_t kind; uint16_t info; char name[1]; };
struct UbsanTypeMismatch { UbsanLocation loc; const UbsanType* type; unsigned char log_alignment; unsigned char kind; };
struct UbsanOutOfBounds { UbsanLocation loc; const UbsanType* array_type; const UbsanType* index_type; };

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

extern "C" __attribute__((visibility("default"))) void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* data,
                                                                                       uintptr_t pointer) {
  emu::fail("misaligned access at %s:%u: address %p of %s needs %u-byte alignment", base_name(data->loc.file),
            data->loc.line, reinterpret_cast<void*>(pointer), data->type->name, 1u << data->log_alignment);
}

extern "C" __attribute__((visibility("default"))) void __ubsan_handle_out_of_bounds(UbsanOutOfBounds* data,
                                                                                    uintptr_t index) {
  emu::fail("index %lld out of bounds of %s at %s:%u", static_cast<long long>(index), data->array_type->name,
            base_name(data->loc.file), data->loc.line);
}
