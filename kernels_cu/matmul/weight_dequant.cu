// Dequantize whole GGUF weight rows: the embedding gather (float32 rows of the token ids) and the f16
// copy of a matrix that the cuBLAS prefill path multiplies.
//
//   weights [n_rows_total, row_bytes] uint8 GGUF blocks (weight_formats.cuh)
//   rows    [n_rows] int32 row ids when has_rows, else rows 0 .. n_rows - 1 are decoded (ids must be in
//           range: the caller checks them)
//   out     [n_rows, n_in] float or __half
//
// NumPy twin: cupyllm/quant/weights.py dequantize, bit for bit for float output; __half output is that
// float32 value rounded once to nearest even (NumPy's astype(float16)).
//
// One thread per part (weight_formats.cuh): it decodes the part and writes its runs.
// Launch: blockDim = 256, gridDim = ceil(n_rows * (n_in / kBlockValues) * kParts / 256), capped;
// the kernel strides over the rest.
#include "matmul/weight_formats.cuh"

namespace cupyllm {

__device__ __forceinline__ void store_value(float* out, float v) { *out = v; }
__device__ __forceinline__ void store_value(__half* out, float v) { *out = __float2half_rn(v); }

}  // namespace cupyllm

template <class W, class Out>
__global__ void __launch_bounds__(256)
weight_dequant(const cupyllm::u8* __restrict__ weights, long long row_bytes, const int* __restrict__ rows,
               int has_rows, int n_rows, int n_in, Out* __restrict__ out) {
    using namespace cupyllm;
    const long long parts_per_row = static_cast<long long>(n_in / W::kBlockValues) * W::kParts;
    const long long n_parts = parts_per_row * n_rows;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_parts;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int row = static_cast<int>(i / parts_per_row);
        const int global_part = static_cast<int>(i % parts_per_row);
        const long long source_row = has_rows ? rows[row] : row;
        int part;
        const u8* block = part_block<W>(weights + source_row * row_bytes, global_part, part);
        float w[W::kPartValues];
        decode_part<W>(block, part, w);
        Out* out_row = out + static_cast<size_t>(row) * n_in;
#pragma unroll
        for (int k = 0; k < W::kPartValues; ++k) store_value(out_row + part_value_column<W>(global_part, k), w[k]);
    }
}
