// Layering check (tests/layering/README.md): the model may use ops (its CPU backend among them),
// the offload backend it uploads its dense part to, format and the layouts.
#include "format/pack_file.h"
#include "offload/dense_offload.h"
#include "ops/cpu_backend.h"
#include "ops/matmul.h"
#include "simd/cache_format.h"
#include "simd/weight_format.h"
