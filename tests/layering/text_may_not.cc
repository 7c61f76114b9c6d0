// Layering check (tests/layering/README.md): text does not see the engine.
#include "ops/sampling.h"
