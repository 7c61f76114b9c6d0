// Layering check (tests/layering/README.md): the offload sits below the runtime that owns it.
#include "runtime/engine.h"
