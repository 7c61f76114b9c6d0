// A completion request from its body to its last byte (POST /v1/chat/completions,
// /v1/completions, /v1/messages): read here, prepared by the runtime (runtime/reply.h: the API's
// fields into the neutral request, each choice's prompt and constraint), admitted by the job
// queue, and answered whole or as a stream of the events the reply produces, each written as the
// scheduler hands it over.
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "cli/serve.h"
#include "cli/serve_http.h"

namespace m3::cli {
namespace {

using ojson = nlohmann::ordered_json;

// How often a writer waiting for its reply (queued, a long prompt) checks that its client is still
// there: the kernel tells no one when the peer of a socket nobody reads hangs up, and a client
// that left should not keep a slot. Pieces of the reply wake the writer at once.
constexpr std::chrono::milliseconds kClientCheck{100};

// The whole reply once every choice has ended; nothing when the client left meanwhile.
void WriteWhole(Server& server, Job& job, GuardedServer::Client client, const httplib::Request& req,
                httplib::Response& res) {
  while (!job.reply->WaitEnded(kClientCheck))
    if (!job.client_gone && client.Gone()) server.jobs->ClientLeft(job);
  if (job.client_gone) return;  // nobody to answer
  if (job.shut_down)
    return SendError(req, res, 503, "the server is shutting down: the reply was stopped before it was complete", 1);
  const StatusOr<std::string> text = job.reply->Whole();
  if (!text.ok()) {
    const int status = HttpStatus(text.status());
    return SendError(req, res, status, text.status().message(), status == 503 ? server.jobs->RetryAfterSeconds() : 0);
  }
  res.set_content(*text, "application/json");
}

// The reply as server-sent events, each written as the reply produces it; a client that hangs up
// (a write fails, or the check while waiting sees it) cancels the request.
void WriteStream(const std::shared_ptr<Server>& server, const std::shared_ptr<Job>& job, GuardedServer::Client client,
                 httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [server, job, client](size_t, httplib::DataSink& sink) {
    std::vector<std::string> events;
    for (;;) {
      events.clear();
      const bool complete = job->reply->TakeEvents(&events, kClientCheck);
      bool gone = events.empty() && !complete && client.Gone();
      for (size_t i = 0; i < events.size() && !gone; ++i) gone = !sink.write(events[i].data(), events[i].size());
      if (gone) {
        server->jobs->ClientLeft(*job);  // the scheduler stops it at its next step
        return false;
      }
      if (complete) {
        sink.done();
        return true;
      }
    }
  });
}

}  // namespace

void HandleCompletion(const std::shared_ptr<Server>& server, Api api, const httplib::Request& req,
                      const httplib::ContentReader& reader, httplib::Response& res) {
  const GuardedServer::Client client = server->http->ConnectionOf(req);
  const std::optional<ojson> body = ReadJsonBody(req, reader, client, res, server->draining);
  if (!body) return;
  const PreparedReply read = Reply::Read(api, *body, server->NewId(), server->replies());
  if (read.seed) res.set_header("X-Seed", std::to_string(*read.seed));  // the request's, or a fresh one
  if (!read.reply) return SendError(req, res, HttpStatus(read.status), read.status.message());
  // Admitted before anything costly (compiling its constraint, rendering its prompts).
  std::optional<Admission> admitted = server->jobs->Admit(read.reply->choice_count());
  if (!admitted)
    return SendError(req, res, 429,
                     Str("the server is busy: ", server->args.slots, " requests generating and ",
                         server->args.max_queue, " waiting (--slots, --max-queue); try again later"),
                     server->jobs->RetryAfterSeconds());
  // A client that leaves meanwhile stops the compilation within ~10 ms.
  const Status built = read.reply->Build(server->replies(), {.stop = [client] { return client.Gone(); }});
  if (!built.ok()) {
    if (client.Gone()) return;  // nobody to answer
    return SendError(req, res, HttpStatus(built), built.message());
  }
  const std::shared_ptr<Job> job = server->jobs->Start(read.reply, req.path, std::move(*admitted));
  if (job->reply->stream()) return WriteStream(server, job, client, res);
  WriteWhole(*server, *job, client, req, res);
}

}  // namespace m3::cli
