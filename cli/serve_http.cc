#include "cli/serve_http.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <exception>
#include <memory>
#include <system_error>
#include <utility>

#include "base/json_guard.h"
#include "base/status.h"
#include "cli/serve.h"
#include "runtime/anthropic.h"
#include "runtime/chat.h"
#include "runtime/openai.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

// Who may talk to the server (issue 35): a page in the user's browser must not reach it across
// origins (a Host allow-list defeats DNS rebinding; JSON-only bodies need a CORS preflight that
// is never granted), and with a key every route but /health needs "Authorization: Bearer KEY".
struct Access {
  std::string api_key;
  std::vector<std::string> hosts;  // "*": any

  // Equal strings in time that depends on their lengths only, not on where they differ.
  static bool SameKey(const std::string& a, const std::string& b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i)
      diff |= static_cast<unsigned char>((i < a.size() ? a[i] : 0) ^ (i < b.size() ? b[i] : 0));
    return diff == 0;
  }
  // The Host header without its port ("[::1]:8080" -> "[::1]").
  static std::string HostName(const std::string& host) {
    if (!host.empty() && host[0] == '[') return host.substr(0, host.find(']') + 1);
    return host.substr(0, host.find(':'));
  }
  bool HostAllowed(const std::string& host) const {
    const std::string name = HostName(host);
    for (const std::string& h : hosts)
      if (h == "*" || h == name) return true;
    return false;
  }
  // Empty: the request may go on; else the refusal (status, message).
  std::optional<std::pair<int, std::string>> Check(const httplib::Request& req) const {
    if (!req.has_header("Host") || !HostAllowed(req.get_header_value("Host")))
      return std::pair{403, "Host '" + req.get_header_value("Host") +
                                "' is not one this server answers to (--allow-host adds names; the "
                                "loopback names are allowed by default)"};
    if (req.path == "/health") return std::nullopt;
    if (!api_key.empty()) {
      const std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      const bool bearer = auth.compare(0, prefix.size(), prefix) == 0 && SameKey(auth.substr(prefix.size()), api_key);
      // Anthropic's clients send the key as "x-api-key".
      const bool x_api_key = req.has_header("x-api-key") && SameKey(req.get_header_value("x-api-key"), api_key);
      if (!bearer && !x_api_key)
        return std::pair{401, std::string("a valid API key is needed: send \"Authorization: Bearer <key>\" (or "
                                          "\"x-api-key: <key>\")")};
    }
    if (req.method == "POST") {
      const std::string type = req.get_header_value("Content-Type");
      if (type.substr(0, type.find(';')) != "application/json")
        return std::pair{415, "request bodies must be sent as Content-Type: application/json, got '" + type + "'"};
    }
    return std::nullopt;
  }
};

// The method a route of this server takes ("" for no such route).
std::string AllowedMethod(const std::string& path) {
  if (path == "/v1/chat/completions" || path == "/v1/completions" || path == "/tokenize" || path == "/detokenize" ||
      path == "/v1/messages" || path == "/v1/messages/count_tokens")
    return "POST";
  if (path == "/health" || path == "/metrics" || path == "/v1/models" || path.rfind("/v1/models/", 0) == 0)
    return "GET";
  return "";
}

// The error body of `req`'s route (Anthropic's API has its own shape).
std::string ErrorText(const httplib::Request& req, const std::string& message, int status) {
  return JsonText(anthropic::IsMessagesPath(req.path) ? anthropic::ErrorBody(message, status)
                                                      : openai::ErrorBody(message, status));
}

// Replies with no route's handler: 404 or 405 naming the method a route takes, and 500 for an
// exception a handler threw.
void AddFallbacks(GuardedServer& http) {
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler's own error
    // A route that exists under another method is a 405 naming the one it takes.
    const std::string allowed = AllowedMethod(req.path);
    if (res.status == 404 && !allowed.empty()) {
      res.status = 405;
      res.set_header("Allow", allowed);
    }
    const std::string what = res.status == 404   ? "no such endpoint: " + req.method + " " + req.path
                             : res.status == 405 ? req.path + " takes " + allowed + ", not " + req.method
                                                 : "HTTP " + std::to_string(res.status);
    res.set_content(ErrorText(req, what, res.status), "application/json");
  });
  http.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(ErrorText(req, what, 500), "application/json");
  });
}

}  // namespace

bool IsLoopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string RouteLabel(const std::string& path) {
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{model}";
  return AllowedMethod(path).empty() ? "other" : path;
}

void SendError(const httplib::Request& req, httplib::Response& res, int status, const std::string& message,
               int retry_after) {
  res.status = status;
  if (retry_after > 0) res.set_header("Retry-After", std::to_string(retry_after));
  res.set_content(ErrorText(req, message, status), "application/json");
}

std::optional<std::string> ReadBody(const httplib::ContentReader& reader) {
  std::string body;
  bool over = false;
  reader([&](const char* data, size_t n) {
    if (body.size() + n > kMaxBodyBytes) {
      over = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (over) return std::nullopt;
  return body;
}

std::optional<ojson> ReadJsonBody(const httplib::Request& req, const httplib::ContentReader& reader,
                                  GuardedServer::Client client, httplib::Response& res, bool draining) {
  // A body announced past the limit is refused before it is read (the connection then closes:
  // its unread bytes are not skipped).
  const std::string length = req.get_header_value("Content-Length");
  uint64_t announced = 0;
  const bool too_long =
      std::from_chars(length.data(), length.data() + length.size(), announced).ec == std::errc::result_out_of_range ||
      announced > kMaxBodyBytes;
  const std::optional<std::string> raw = too_long ? std::nullopt : ReadBody(reader);
  client.RequestRead();  // from here on, the reply takes what time it takes
  if (!raw || draining) {
    res.set_header("Connection", "close");
    client.CloseAfterReply();
    if (!raw)
      SendError(req, res, 413,
                Str("the request body is larger than ", kMaxBodyBytes >> 20,
                    " MiB (counted after its transfer and content encodings are undone)"));
    else
      SendError(req, res, 503, "the server is shutting down", 1);
    return std::nullopt;
  }
  StatusOr<ojson> body = ParseJson<ojson>(*raw, "the request body");
  if (!body.ok()) {
    SendError(req, res, 400, body.status().message());
    return std::nullopt;
  }
  return std::move(body).value();
}

void AddHttpGuards(GuardedServer& http, const std::shared_ptr<Server>& server) {
  auto access = std::make_shared<Access>();
  access->api_key = server->args.api_key;
  access->hosts = server->args.allow_host.empty() ? std::vector<std::string>{"localhost", "127.0.0.1", "[::1]"}
                                                  : server->args.allow_host;
  // Before routing and before any body is read.
  http.set_pre_routing_handler([access](const httplib::Request& req, httplib::Response& res) {
    const auto refusal = access->Check(req);
    if (!refusal) return httplib::Server::HandlerResponse::Unhandled;
    if (refusal->first == 401) res.set_header("WWW-Authenticate", "Bearer");
    SendError(req, res, refusal->first, refusal->second);
    return httplib::Server::HandlerResponse::Handled;
  });
  // Counted before the response is written (httplib calls the logger after it: a client that
  // reads its answer and asks /metrics at once could see the request not yet counted).
  http.set_post_routing_handler([server](const httplib::Request& req, httplib::Response& res) {
    server->metrics.Answered(RouteLabel(req.path), res.status);
  });
  http.set_payload_max_length(kMaxBodyBytes);  // on the wire; ReadBody counts what it decodes to
  http.Get("/health", [server](const httplib::Request& req, httplib::Response& res) {
    if (server->draining) return SendError(req, res, 503, "the server is shutting down", 1);
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  AddFallbacks(http);
}

}  // namespace m3::cli
