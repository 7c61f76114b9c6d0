// Layering check (tests/layering/README.md): format may use platform, base and the layouts.
#include "platform/mapped_file.h"
#include "simd/weight_format.h"
