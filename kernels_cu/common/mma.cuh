// Warp-level tensor-core and async-copy primitives, one inline wrapper each: PTX on the GPU, the CPU
// emulator's implementation on the host (tools/cuda_emu, which defines CUPYLLM_EMULATOR), so kernel
// sources are the same for both.
//
// mma_m16n8k16: D = A B + C with A 16x16 f16 (row major), B 16x8 f16 (column major), C/D 16x8 f32.
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]     b[1] = B[2t+8..2t+9][g]
//   c[0] = C[g][2t]  c[1] = C[g][2t+1]  c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]
// (each u32 holds two f16, the lower index in the low half). The accumulator layout of one n8 tile pair
// (keys 0..7 and 8..15) is therefore the A layout of a k16 step: P = softmax(S) feeds P V without
// going through shared memory.
//
// ldmatrix_x4<kTrans>(r, row): four 8x8 b16 matrices from shared memory in one warp instruction (PTX
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16). Lane l gives the address of row l % 8 of matrix l / 8
// (16 bytes, 16-byte aligned); r[m] of lane l is then the word (row l / 4, halves 2(l % 4), 2(l % 4) + 1) of
// matrix m, or with kTrans the two halves (rows 2(l % 4), 2(l % 4) + 1; column l / 4): matrix m's part of an
// mma fragment (row-major A, the B of a row-major K; with kTrans the B of a row-major V).
//
// cp_async<kBytes>: copy kBytes (4, 8 or 16; both addresses aligned to it) global -> shared without
// registers, zero-filling when `valid` is false (the source is not read then). Groups as in PTX:
// cp_async_commit() closes a group, cp_async_wait<N>() waits until at most N groups are pending;
// a __syncthreads() after the wait makes every thread's copies visible to the block.
#pragma once

#include "common/common.cuh"

namespace cupyllm {

__device__ __forceinline__ void mma_m16n8k16_f16_f32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                                     const float (&c)[4]) {
#if defined(CUPYLLM_EMULATOR)
    emu::mma_m16n8k16_f16_f32(d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
#endif
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const __half* row) {
#if defined(CUPYLLM_EMULATOR)
    emu::ldmatrix_x4(r, row, kTrans);
#else
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if constexpr (kTrans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
    }
#endif
}

// Two floats -> one u32 of two f16 (round to nearest), `lo` in the low half.
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    return static_cast<u32>(float_to_f16_bits(lo)) | (static_cast<u32>(float_to_f16_bits(hi)) << 16);
}

template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src, bool valid) {
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(CUPYLLM_EMULATOR)
    emu::cp_async(smem_dst, gmem_src, kBytes, valid ? kBytes : 0);
#else
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_bytes = valid ? kBytes : 0;
    if constexpr (kBytes == 16) {  // .cg: stream through L2 only (every byte is read once)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem_src), "n"(kBytes),
                     "r"(src_bytes));
    }
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(CUPYLLM_EMULATOR)
    emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int kPendingGroups>
__device__ __forceinline__ void cp_async_wait() {
#if defined(CUPYLLM_EMULATOR)
    emu::cp_async_wait(kPendingGroups);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
#endif
}

// Bytes of dynamic shared memory this launch was given (kernels check it against their layout).
__device__ __forceinline__ u32 dynamic_smem_bytes() {
#if defined(CUPYLLM_EMULATOR)
    return static_cast<u32>(emu::dynamic_smem_size());
#else
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
#endif
}

}  // namespace cupyllm
