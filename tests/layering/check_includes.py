#!/usr/bin/env python3
"""The layers' direct includes against the picture in docs/ARCHITECTURE.md.

The build already refuses an include against the direction of the layers (a layer sees only what
it links; tests/layering/*_may_not.cc). What it cannot refuse is a skip: a layer that links model
also sees ops through it, so runtime could include an ops header without the picture drawing
runtime -> ops. This script reads every `#include "layer/..."` of lib/, simd/, cli/ and bench/
and fails on any layer edge that ALLOWED (the picture, as data) does not draw.

Usage: check_includes.py SOURCE_ROOT      check the tree
       check_includes.py --self-test      check that a skip and an upward include are caught
"""
import os
import re
import sys
import tempfile

# Folder -> layer.
FOLDERS = {
    'lib/base': 'base', 'lib/platform': 'platform', 'lib/format': 'format', 'simd': 'simd',
    'lib/ops': 'ops', 'lib/offload': 'offload', 'lib/model': 'model', 'lib/cluster': 'cluster',
    'lib/text': 'text', 'lib/constrain': 'constrain', 'lib/runtime': 'runtime', 'lib/capi': 'capi',
    'cli': 'cli', 'bench': 'bench',
}
# The layers each layer may include directly (besides its own). `layout` is simd's two layout
# headers, which format, ops and model see without seeing a kernel.
ALLOWED = {
    'base': set(),
    'platform': {'base'},
    'format': {'base', 'platform', 'layout'},
    'simd': {'layout'},
    'ops': {'base', 'platform', 'layout', 'simd'},
    'offload': {'base', 'platform', 'layout', 'ops'},
    'model': {'base', 'platform', 'layout', 'format', 'ops', 'offload'},
    'cluster': {'base', 'platform', 'ops', 'model'},
    'text': {'base'},
    'constrain': {'base', 'text'},
    'runtime': {'base', 'platform', 'ops', 'offload', 'model', 'cluster', 'text', 'constrain'},
    'capi': {'base', 'ops', 'runtime'},
    'bench': {'base', 'platform', 'layout', 'simd', 'format', 'ops', 'model', 'text', 'constrain', 'runtime'},
    'cli': {'base', 'platform', 'format', 'ops', 'offload', 'model', 'cluster', 'text', 'runtime', 'bench'},
}
LAYOUT_HEADERS = {'weight_format.h', 'cache_format.h'}
INCLUDE = re.compile(r'\s*#\s*include\s+"([a-z0-9_]+)/([^"]+)"')
SKIP_DIRS = {'peer'}  # bench/peer: the llama.cpp peer, built apart against llama.cpp's headers


def target_layer(prefix, header):
    if prefix == 'simd' and header in LAYOUT_HEADERS:
        return 'layout'
    if prefix == 'm3':
        return 'capi'
    return prefix if prefix in ALLOWED else None


def violations(root):
    found = []
    for folder, layer in FOLDERS.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in sorted(files):
                if not name.endswith(('.h', '.cc', '.cu', '.c')):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding='utf-8', errors='replace') as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        other = target_layer(m.group(1), m.group(2))
                        if other and other != layer and other not in ALLOWED[layer]:
                            rel = os.path.relpath(path, root)
                            found.append(f'{rel}:{number}: {layer} may not include {other} ("{m.group(1)}/{m.group(2)}")')
    return found


def self_test():
    with tempfile.TemporaryDirectory() as root:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), 'w') as f:
                f.write(text)
        write('lib/runtime/ok.cc', '#include "model/model.h"\n#include "ops/context.h"\n')
        write('lib/capi/skip.cc', '#include "runtime/engine.h"\n#include "model/model.h"\n')  # skips runtime
        write('lib/ops/up.cc', '#include "simd/weight_format.h"\n#include "model/model.h"\n')  # upward
        write('lib/model/layout.cc', '#include "simd/cache_format.h"\n')  # layouts only: fine
        write('lib/model/kernel.cc', '#include "simd/kernels.h"\n')  # a kernel: not for model
        got = violations(root)
        want = ['capi may not include model', 'ops may not include model', 'model may not include simd']
        missing = [w for w in want if not any(w in g for g in got)]
        if missing or len(got) != len(want):
            print('self-test FAILED: got', got, 'missing', missing)
            return 1
    print('self-test passed: a skip, an upward include and a kernel include are refused')
    return 0


def main():
    if len(sys.argv) == 2 and sys.argv[1] == '--self-test':
        return self_test()
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    found = violations(sys.argv[1])
    for v in found:
        print(v)
    if found:
        print(f'{len(found)} include(s) the layer picture does not draw (docs/ARCHITECTURE.md, ALLOWED here)')
        return 1
    print('every include follows an edge of the layer picture')
    return 0


if __name__ == '__main__':
    sys.exit(main())
