// The HTTP side of `m3 serve` that every route shares: who may talk to the server (a Host
// allow-list, an API key, JSON bodies only), error replies in the shape of the route's API, and
// request bodies read within a size limit.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/serve_connections.h"

namespace m3::cli {

// Whether `host` (--host) is a loopback address.
bool IsLoopback(const std::string& host);

// An error reply: {"error": ...} in OpenAI's shape, or Anthropic's on the Anthropic routes;
// `retry_after` > 0 sets Retry-After (seconds).
void SendError(const httplib::Request& req, httplib::Response& res, int status, const std::string& message,
               int retry_after = 0);

// The largest request body, counted as the handler receives it: after chunked transfer coding
// and Content-Encoding (gzip, brotli) are undone. httplib's own limit sees the bytes on the wire
// only, so a 100 KB gzip body could inflate to 100 MB.
inline constexpr size_t kMaxBodyBytes = size_t{64} << 20;

// A POST body read through the content reader, or nothing once it passes kMaxBodyBytes (the
// reading stops there).
std::optional<std::string> ReadBody(const httplib::ContentReader& reader);
// A request's JSON body; nullopt: refused (413 when past kMaxBodyBytes, announced or read; 400 when
// not JSON; 503 when `draining`: a completion that would start as the server shuts down).
std::optional<nlohmann::ordered_json> ReadJsonBody(const httplib::Request& req, const httplib::ContentReader& reader,
                                                   GuardedServer::Client client, httplib::Response& res,
                                                   bool draining = false);

// The route label of a request path (/metrics): the routes themselves, one label for a model's
// page, and "other" for any other path (labels stay few whatever clients send).
std::string RouteLabel(const std::string& path);

}  // namespace m3::cli
