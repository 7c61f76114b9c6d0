// Layering check (tests/layering/README.md): text may use base.
#include "base/status.h"
