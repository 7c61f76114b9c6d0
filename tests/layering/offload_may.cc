// Layering check (tests/layering/README.md): the offload runs the steps of a pass (ops/backend.h)
// on a Device, and the CPU's operators (the routed experts).
#include "offload/dense_offload.h"
#include "offload/device.h"
#include "ops/backend.h"
#include "ops/moe.h"
