// Layering check (tests/layering/README.md): the model reaches kernels only through ops.
#include "simd/kernels.h"
