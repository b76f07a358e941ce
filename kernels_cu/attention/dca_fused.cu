// Dual Chunk Attention, fused: one flash-attention pass over the cache per query block that walks the
// intra, successive and inter key ranges under ONE online softmax (cupyllm/attention/gpu_dca.py runs it;
// cupyllm/attention/dca.py defines the semantics).
//
// Q arrives in three rotations, Q[3][n_q][n_head][D] (intra, successive, inter; scaled, and rotated for
// the rotated K formats, by one fa_prep_q launch). Key j of query i is scored with the rotation of its
// regime, min(chunk(pos_i) - chunk(pos_j), 2) with chunk(p) = p / chunk_len (true positions from the
// cache's slot_pos). K is cached once, roped at its in-chunk position p mod chunk_len, and read once in
// its encoded format (every KV type dequantized in registers, as for plain attention). Mask, softcap,
// split-KV partial (O, LSE) and the fa_combine merge are those of plain attention, so a row that sees no
// key (an empty regime set) contributes O = 0, LSE = -inf and never a NaN.
//
// The kernels are the kDca = true instantiations of the FA-VEC and FA-MMA templates (fa_vec.cuh, fa_mma.cuh,
// regime helpers in fa_common.cuh):
//   fa_vec<D, 8, true>        decode and a few query rows: per key tile, one score pass per regime the tile
//                             can hold (one pass in the common case of a tile inside one chunk);
//   fa_mma<D, kDecode, true>  prefill (kDecode = false) and tensor-core decode (true): the Q tile in shared
//                             memory holds one rotation, reloaded when a tile's regime changes; a tile
//                             across a chunk boundary recomputes the pairs of its other regime.
// Head dims 64 / 128 / 256 / 512 (cupyllm/attention/gpu_kernels.py lists the instantiations).
#include "attention/fa_vec.cuh"
#include "attention/fa_mma.cuh"
