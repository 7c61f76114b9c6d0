// Layering check (tests/layering/README.md): the CLI does not see the kernels.
#include "simd/kernels.h"
