// FA-MMA entry points: the plain instantiations fa_mma<D, kDecode> (tensor-core flash attention for prefill
// and many query rows). The kernel template and its design are in fa_mma.cuh; the Dual Chunk Attention
// instantiations of the same template are compiled from dca_fused.cu.
#include "attention/fa_mma.cuh"
