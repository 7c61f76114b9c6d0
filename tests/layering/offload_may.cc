// Layering check (tests/layering/README.md): the offload drives the model's weights, caches and
// operators (the CPU's routed experts) through a Device.
#include "model/model.h"
#include "offload/dense_offload.h"
#include "offload/device.h"
#include "ops/moe.h"
