// Layering check (tests/layering/README.md): simd (the kernels) does not see the file format.
#include "format/pack_file.h"
