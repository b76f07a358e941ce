// FA-VEC entry points: the plain instantiations fa_vec<D, kRows> (decode, few query rows per KV head).
// The kernel template and its design are in fa_vec.cuh; the Dual Chunk Attention instantiations of the same
// template are compiled from dca_fused.cu.
#include "attention/fa_vec.cuh"
