// m3: MiniMax-M3 inference on CPUs.
#include <cstdio>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"m3: MiniMax-M3 inference on CPUs"};
  app.require_subcommand(1);
  int rc = 0;
  m3::cli::AddInspectCommand(app, &rc);
  m3::cli::AddLogitsCommand(app, &rc);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return rc;
}
