// Layering check (tests/layering/README.md): format does not see the kernels beside it.
#include "simd/quant_kernels.h"
