// Anthropic's routes of `m3 serve`: POST /v1/messages (whole, or streamed as Anthropic's events)
// and POST /v1/messages/count_tokens (no model pass). The shapes are runtime/anthropic.h's; errors
// on these routes take Anthropic's shape (SendError).
#include <optional>

#include "cli/serve.h"
#include "cli/serve_http.h"
#include "runtime/anthropic.h"
#include "runtime/chat.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

// POST /v1/messages/count_tokens: the length of the prompt the template renders.
void HandleCountTokens(Server& server, const httplib::Request& req, const httplib::ContentReader& reader,
                       httplib::Response& res) {
  const std::optional<ojson> body = ReadJsonBody(req, reader, server.http->ConnectionOf(req), res);
  if (!body) return;
  const StatusOr<ojson> out = anthropic::CountTokens(*server.text, *body, server.args.defaults);
  if (!out.ok()) return SendError(req, res, HttpStatus(out.status()), out.status().message());
  res.set_content(JsonText(*out), "application/json");
}

}  // namespace

void AddAnthropicRoutes(GuardedServer& http, const std::shared_ptr<Server>& server) {
  http.Post("/v1/messages",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, Api::kMessages, req, reader, res);
            });
  http.Post("/v1/messages/count_tokens",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCountTokens(*server, req, reader, res);
            });
}

}  // namespace m3::cli
