# Every dependency comes from a Debian package (scripts/install-deps.sh installs them).
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(hwy REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(Threads REQUIRED)
if(M3_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()
