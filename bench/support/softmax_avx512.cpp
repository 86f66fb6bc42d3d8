// The same row softmax compiled with AVX-512 flags (16-lane libmvec expf).
#define QKV_SOFTMAX_NAME softmax_row_avx512
#include "softmax_generic.cpp"
