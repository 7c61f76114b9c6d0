// Layering check (tests/layering/README.md): the model may use ops, format and the layouts.
#include "format/pack_file.h"
#include "ops/matmul.h"
#include "simd/cache_format.h"
#include "simd/weight_format.h"
