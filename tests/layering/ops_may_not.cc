// Layering check (tests/layering/README.md): ops may not include the model above it.
#include "model/model.h"
