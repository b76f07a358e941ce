// Decode a range of cache rows to f16 (prefill on the GPU and parity checks).
//
//   cache [n_slots, n_heads, row_bytes] uint8; rows row_start .. row_start + n_rows - 1 are decoded
//   out   [n_rows, n_heads, head_dim] __half
//   table the format's float table (kv_formats.cuh); scalar formats ignore it
//
// kv_decode<Fmt, kUnrotate>: scalar formats decode one value per thread with Fmt::dequant; rotated
// formats decode one group per warp and, when kUnrotate, apply the inverse rotation in registers
// (turbo.unrotate), giving the original-domain values. With kUnrotate false the rotated-domain
// values come out (what attention with a rotated Q consumes). The f32 values are those of the NumPy
// decode bit for bit; the output rounds them once to f16.
//
// Launch geometry (mirrored in cupyllm/backend/gpu_kv.py): blockDim = Decoder::kCtaThreads,
// gridDim = ceil(n_units / Decoder::kUnitsPerCta), n_units = n_rows * n_heads * head_dim / kUnitValues.
#include "kv_formats/kv_formats.cuh"

namespace cupyllm {

template <class Fmt, bool kRotated = Fmt::kRotated>
struct Decoder {  // scalar formats: one thread per value
    static constexpr int kUnitValues = 1, kUnitThreads = 1, kUnitsPerCta = 256, kCtaThreads = 256;
    template <bool kUnrotate>
    __device__ static void decode(const u8* row, int first_value, const float* table, __half* out, int) {
        out[0] = __float2half_rn(load_kv_value<Fmt>(row, first_value, table));
    }
};

template <class Fmt>
struct Decoder<Fmt, true> {  // rotated formats: one warp per group, value i in lane i % 32
    static constexpr int G = Fmt::kBlockValues;
    static constexpr int kUnitValues = G, kUnitThreads = 32, kUnitsPerCta = 4, kCtaThreads = 128;
    template <bool kUnrotate>
    __device__ static void decode(const u8* row, int first_value, const float* table, __half* out, int lane) {
        const u8* block = row + (first_value / G) * Fmt::kBlockBytes;
        float v[G / 32];
#pragma unroll
        for (int s = 0; s < G / 32; ++s) v[s] = Fmt::dequant(block, s * 32 + lane, table);
        if constexpr (kUnrotate) warp_unrotate<G>(v, lane);
#pragma unroll
        for (int s = 0; s < G / 32; ++s) out[s * 32 + lane] = __float2half_rn(v[s]);
    }
};

}  // namespace cupyllm

template <class Fmt, bool kUnrotate>
__global__ void __launch_bounds__(cupyllm::Decoder<Fmt>::kCtaThreads)
kv_decode(const cupyllm::u8* __restrict__ cache, int row_start, int n_rows, int n_heads, int head_dim,
          const float* __restrict__ table, __half* __restrict__ out) {
    using D = cupyllm::Decoder<Fmt>;
    const int units_per_head = head_dim / D::kUnitValues;
    const long long n_units = static_cast<long long>(n_rows) * n_heads * units_per_head;
    const long long unit = static_cast<long long>(blockIdx.x) * D::kUnitsPerCta + threadIdx.x / D::kUnitThreads;
    if (unit >= n_units) return;  // uniform per warp for the warp decoders
    const long long head_row = unit / units_per_head;  // (row, head) pair, row-major
    const int first_value = static_cast<int>(unit % units_per_head) * D::kUnitValues;
    const size_t row_bytes = static_cast<size_t>(head_dim / Fmt::kBlockValues) * Fmt::kBlockBytes;
    const cupyllm::u8* row = cache + (static_cast<size_t>(row_start) * n_heads + head_row) * row_bytes;
    __half* dst = out + static_cast<size_t>(head_row) * head_dim + first_value;
    D::template decode<kUnrotate>(row, first_value, table, dst, threadIdx.x % D::kUnitThreads);
}
