// Layering check (tests/layering/README.md): constrain may use text and base.
#include "base/status.h"
#include "constrain/constrain.h"
#include "text/output_parser.h"
