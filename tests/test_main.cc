#define CATCH_CONFIG_RUNNER
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <string>

int main(int argc, char* argv[]) {
  // The stamps of background weight checks (model/background_verify.h) go to a folder of this
  // run's, not the user's cache.
  const std::filesystem::path cache =
      std::filesystem::temp_directory_path() / ("m3_test_cache_" + std::to_string(::getpid()));
  ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
  const int rc = Catch::Session().run(argc, argv);
  std::error_code ec;
  std::filesystem::remove_all(cache, ec);
  return rc;
}
