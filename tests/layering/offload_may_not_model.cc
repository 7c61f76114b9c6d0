// Layering check (tests/layering/README.md): the offload is a backend beneath the model: it knows
// the pass's steps (ops/backend.h), not MiniMax-M3.
#include "model/model.h"
