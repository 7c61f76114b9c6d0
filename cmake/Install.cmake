# `cmake --install build [--prefix P]` (scripts/install.sh does it in one step): libm3.so with its
# SONAME link, the public headers (m3/m3.h, m3/m3.hpp), the m3 executable, a CMake package (m3::m3),
# m3.pc for pkg-config and the Python module (python/m3, over the C API through ctypes). Every file
# names the others by relative paths, so a prefix can be moved or chosen at install time.
# docs/LIBRARY.md ("Use it from your project") shows each way in; tests/install_check.sh installs into
# a temporary prefix and builds examples/ against it.
include(CMakePackageConfigHelpers)

option(M3_INSTALL_STATIC "Also build and install libm3.a: every layer of the engine in one archive" OFF)
set(M3_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/m3)

install(TARGETS m3_shared EXPORT m3Targets LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(FILES ${CMAKE_SOURCE_DIR}/lib/include/m3/m3.h ${CMAKE_SOURCE_DIR}/lib/include/m3/m3.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/m3)
install(TARGETS m3_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# What a static link of libm3.a needs besides it (pkg-config's Libs.private, m3::m3_static):
# the shared library carries these as its own DT_NEEDED entries.
set(_m3_private_libs ${OpenMP_CXX_LIBRARIES} ${MPI_C_LIBRARIES} ${PCRE2_LINK_LIBRARIES} ${ICU_LIBRARIES})
get_target_property(_m3_hwy hwy::hwy LOCATION)
list(PREPEND _m3_private_libs ${_m3_hwy})
if(M3_HAVE_NUMA)
  list(APPEND _m3_private_libs ${M3_NUMA_LIBRARY})
endif()
if(M3_HAVE_CUDA)  # the CUDA module's runtime, linked statically into libm3.so
  list(APPEND _m3_private_libs ${CUDA_cudart_static_LIBRARY} rt)
endif()
list(APPEND _m3_private_libs stdc++ m pthread dl)
list(REMOVE_DUPLICATES _m3_private_libs)
set(_m3_libs_private "")
foreach(lib ${_m3_private_libs})
  if(IS_ABSOLUTE "${lib}")
    string(APPEND _m3_libs_private " ${lib}")
  else()
    string(APPEND _m3_libs_private " -l${lib}")
  endif()
endforeach()
string(STRIP "${_m3_libs_private}" _m3_libs_private)

if(M3_INSTALL_STATIC)
  # The layers' archives merged into one (ar's MRI script), so that -lm3 is the whole engine.
  set(_m3_layers m3_base m3_platform m3_format m3_simd m3_ops m3_offload m3_model m3_cluster m3_text m3_constrain
                 m3_runtime m3_lib)
  set(_m3_mri "CREATE ${CMAKE_BINARY_DIR}/lib/libm3.a\n")
  set(_m3_layer_files)
  foreach(layer ${_m3_layers})
    string(APPEND _m3_mri "ADDLIB $<TARGET_FILE:${layer}>\n")
    list(APPEND _m3_layer_files $<TARGET_FILE:${layer}>)
  endforeach()
  string(APPEND _m3_mri "SAVE\nEND\n")
  file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/lib/libm3.mri CONTENT "${_m3_mri}")
  add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/lib/libm3.a
                     COMMAND ${CMAKE_COMMAND} -E rm -f ${CMAKE_BINARY_DIR}/lib/libm3.a
                     COMMAND sh -c "'${CMAKE_AR}' -M < '${CMAKE_BINARY_DIR}/lib/libm3.mri'"
                     DEPENDS ${_m3_layers} ${_m3_layer_files} VERBATIM
                     COMMENT "Merging the engine's layers into libm3.a")
  add_custom_target(m3_static_archive ALL DEPENDS ${CMAKE_BINARY_DIR}/lib/libm3.a)
  install(FILES ${CMAKE_BINARY_DIR}/lib/libm3.a DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()

# The CMake package: find_package(m3 CONFIG REQUIRED), then target_link_libraries(app m3::m3)
# (or m3::m3_static where libm3.a was installed).
install(EXPORT m3Targets NAMESPACE m3:: DESTINATION ${M3_CMAKE_DIR})
set(M3_STATIC_LINK_LIBRARIES "${_m3_private_libs}")
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/m3Config.cmake.in ${CMAKE_BINARY_DIR}/m3Config.cmake
                              INSTALL_DESTINATION ${M3_CMAKE_DIR})
# 0.x: a minor version may change the ABI, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/m3ConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/m3Config.cmake ${CMAKE_BINARY_DIR}/m3ConfigVersion.cmake DESTINATION ${M3_CMAKE_DIR})

# pkg-config: the prefix is found from the .pc file's own folder (relocatable); Libs carries an
# rpath to the library's folder, so a program built with `cc app.c $(pkg-config --cflags --libs m3)`
# runs from a prefix outside the loader's path (~/.local, the default of scripts/install.sh).
file(RELATIVE_PATH M3_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
string(REGEX REPLACE "/$" "" M3_PC_TO_PREFIX "${M3_PC_TO_PREFIX}")
set(M3_PC_LIBS_PRIVATE "${_m3_libs_private}")
configure_file(${CMAKE_SOURCE_DIR}/cmake/m3.pc.in ${CMAKE_BINARY_DIR}/m3.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/m3.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The Python module, where the user's Python looks for it: <prefix>/lib/python3.X/site-packages
# (with the default prefix ~/.local that is the user site, on sys.path already). It loads the
# libm3.so of the same prefix by a path relative to its own folder.
find_program(M3_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_program(M3_PYTHON3 python3)
set(_m3_python_version 3)
if(M3_PYTHON3)
  execute_process(COMMAND ${M3_PYTHON3} -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
                  OUTPUT_VARIABLE _m3_python_version OUTPUT_STRIP_TRAILING_WHITESPACE)
endif()
set(M3_PYTHON_SITE lib/python${_m3_python_version}/site-packages CACHE STRING
    "Where the Python module is installed, relative to the prefix")
file(RELATIVE_PATH M3_PYTHON_TO_LIBDIR /p/${M3_PYTHON_SITE}/m3 /p/${CMAKE_INSTALL_LIBDIR})
string(REGEX REPLACE "/$" "" M3_PYTHON_TO_LIBDIR "${M3_PYTHON_TO_LIBDIR}")
set(M3_SONAME libm3.so.${PROJECT_VERSION_MAJOR})
configure_file(${CMAKE_SOURCE_DIR}/python/m3/_library.py.in ${CMAKE_BINARY_DIR}/python/m3/_library.py @ONLY)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/python/m3 DESTINATION ${M3_PYTHON_SITE}
        FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
install(FILES ${CMAKE_BINARY_DIR}/python/m3/_library.py DESTINATION ${M3_PYTHON_SITE}/m3)
