// Layering check (tests/layering/README.md): base includes nothing of the engine.
#include "platform/parallel.h"
