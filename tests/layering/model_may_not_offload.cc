// Layering check (tests/layering/README.md): the model knows nothing of where its dense part runs.
#include "offload/device.h"
