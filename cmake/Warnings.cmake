add_library(m3_warnings INTERFACE)
target_compile_options(m3_warnings INTERFACE -Wall -Wextra -Wno-unused-parameter)
if(M3_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "M3_FUZZ needs clang (libFuzzer): configure with CC=clang CXX=clang++")
  endif()
  # Every library instrumented for coverage and checked; the targets add -fsanitize=fuzzer. Line
  # tables only (-g1): all the reports' stacks need, and a faster build.
  add_compile_options(-fsanitize=address,undefined,fuzzer-no-link -fno-omit-frame-pointer -g1)
  add_link_options(-fsanitize=address,undefined)
elseif(M3_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
elseif(M3_TSAN)
  # -O1 with line tables: what ThreadSanitizer's stacks need, and a quarter faster to build than -O3.
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer -O1 -g1)
  add_link_options(-fsanitize=thread)
endif()
