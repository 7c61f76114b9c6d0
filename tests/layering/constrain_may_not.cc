// Layering check (tests/layering/README.md): constrain does not see the engine.
#include "runtime/generate.h"
