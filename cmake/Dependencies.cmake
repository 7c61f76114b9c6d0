# Every dependency comes from a Debian package (scripts/install-deps.sh installs them).
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(hwy REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(Threads REQUIRED)
# Tokenizer: PCRE2 runs the pre-tokenizer regex, ICU does the NFC normalization.
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
find_package(ICU REQUIRED COMPONENTS uc)
if(M3_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
endif()
