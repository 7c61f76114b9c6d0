// OpenAI's routes of `m3 serve`: POST /v1/chat/completions and /v1/completions (whole, or with
// "stream": true as server-sent events; "n" choices each), GET /v1/models and /v1/models/{id},
// POST /tokenize and /detokenize (no model pass). The shapes are runtime/openai.h's.
#include <string>

#include "cli/serve.h"
#include "cli/serve_http.h"
#include "runtime/chat.h"
#include "runtime/openai.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

ojson ModelObject(const Server& server) {
  return {{"id", server.args.name},
          {"object", "model"},
          {"created", 0},
          {"owned_by", "m3"},
          {"max_model_len", server.scheduler->max_context()}};
}

// POST /tokenize and /detokenize (openai::Tokenize, openai::Detokenize).
void HandleTokens(Server& server, bool tokenize, const httplib::Request& req, const httplib::ContentReader& reader,
                  httplib::Response& res) {
  const std::optional<ojson> body = ReadJsonBody(req, reader, server.http->ConnectionOf(req), res);
  if (!body) return;
  const StatusOr<ojson> out =
      tokenize ? openai::Tokenize(*server.text, *body, server.args.defaults, server.scheduler->max_context())
               : openai::Detokenize(server.text->tokenizer(), *body);
  if (!out.ok()) return SendError(req, res, HttpStatus(out.status()), out.status().message());
  res.set_content(JsonText(*out), "application/json");
}

}  // namespace

void AddOpenAIRoutes(GuardedServer& http, const std::shared_ptr<Server>& server) {
  http.Get("/v1/models", [server](const httplib::Request&, httplib::Response& res) {
    res.set_content(JsonText(ojson{{"object", "list"}, {"data", ojson::array({ModelObject(*server)})}}),
                    "application/json");
  });
  http.Get(R"(/v1/models/(.+))", [server](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] != server->args.name)
      return SendError(req, res, 404,
                       "no model '" + std::string(req.matches[1]) + "': this server has '" + server->args.name + "'");
    res.set_content(JsonText(ModelObject(*server)), "application/json");
  });
  http.Post("/v1/chat/completions",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, Api::kChatCompletions, req, reader, res);
            });
  http.Post("/v1/completions",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleCompletion(server, Api::kCompletions, req, reader, res);
            });
  http.Post("/tokenize",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleTokens(*server, true, req, reader, res);
            });
  http.Post("/detokenize",
            [server](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
              HandleTokens(*server, false, req, reader, res);
            });
}

}  // namespace m3::cli
