# One static library per layer, each seeing only the headers of what it links (docs/ARCHITECTURE.md).
#
# Headers are included with their layer's name ("simd/kernels.h", "ops/matmul.h"). No target gets the
# source root or lib/ as an include directory: a layer's headers are reachable only through a folder
# in the build tree that holds one link, <build>/layers/<layer>/<layer> -> the layer's sources, and
# only the layer's target puts that folder on its include path (PUBLIC, so what links the layer sees
# it too, and what does not link it cannot include it). An include against the direction of the
# layers therefore fails to compile.
function(m3_layer_headers target layer source_dir)
  set(root ${CMAKE_BINARY_DIR}/layers/${layer})
  file(MAKE_DIRECTORY ${root})
  file(CREATE_LINK ${source_dir} ${root}/${layer} SYMBOLIC)
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    target_include_directories(${target} INTERFACE $<BUILD_INTERFACE:${root}>)
  else()
    target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${root}>)
  endif()
endfunction()

# The "layout" part of the simd layer: the byte layouts of stored weights and cache entries
# (simd/weight_format.h, simd/cache_format.h), plain data that format, ops and model share. Its
# folder links those two headers only, so seeing the layouts does not mean seeing a kernel.
function(m3_layout_headers target)
  set(root ${CMAKE_BINARY_DIR}/layers/layout/simd)
  file(MAKE_DIRECTORY ${root})
  foreach(h ${ARGN})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/simd/${h} ${root}/${h} SYMBOLIC)
  endforeach()
  target_include_directories(${target} INTERFACE $<BUILD_INTERFACE:${CMAKE_BINARY_DIR}/layers/layout>)
endfunction()
