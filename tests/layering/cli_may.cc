// Layering check (tests/layering/README.md): the CLI may use the runtime.
#include "runtime/engine.h"
