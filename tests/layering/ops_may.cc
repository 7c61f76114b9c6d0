// Layering check (tests/layering/README.md): ops may use the kernels, the layouts, platform and base.
#include "base/status.h"
#include "platform/parallel.h"
#include "simd/kernels.h"
#include "simd/weight_format.h"
