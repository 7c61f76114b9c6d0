// A completion request of `m3 serve` from its body to its reply: read by its API
// (runtime/openai.h, runtime/anthropic.h) into the vendor-neutral Request, its choices' prompts
// and output constraints prepared (runtime/request.h), run by the scheduler, and written in the
// API's shape - whole once every choice has ended, or as a stream whose events reach the writer
// as the scheduler makes them (each piece wakes it). The server (cli/serve_*.cc) does the HTTP
// around it: it reads the body, admits the request, writes what the reply produces and cancels
// it when its client leaves.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace m3 {

// The endpoints a reply is written for: OpenAI's /v1/chat/completions and /v1/completions,
// Anthropic's /v1/messages.
enum class Api { kChatCompletions, kCompletions, kMessages };

// How an API writes a reply. A stream is a list of events, each the wire text of one server-sent
// event, in this order: Open, then each choice's pieces and its end, then Close (every choice
// ended well) or Fail (one failed, or the reply was stopped).
class ReplyFormat {
 public:
  virtual ~ReplyFormat() = default;
  virtual void Open(std::vector<std::string>* events) = 0;
  virtual void Piece(size_t choice, const TurnDelta& d, std::vector<std::string>* events) = 0;
  virtual void ChoiceEnd(size_t choice, const ChoiceResult& result, std::vector<std::string>* events) = 0;
  virtual void Close(const std::vector<ChoiceResult>& choices, std::vector<std::string>* events) = 0;
  virtual void Fail(const Status& why, std::vector<std::string>* events) = 0;
  // The whole reply once every choice has ended, or the first failed choice's status.
  virtual StatusOr<std::string> Whole(const std::vector<ChoiceResult>& choices) = 0;
};

// What a reply needs of the server.
struct ReplyContext {
  const ChatText& text;
  Scheduler& scheduler;
  const RequestDefaults& defaults;
  const std::string& model;  // the name replies give the model
};

class Reply;

// A request prepared to run, or why not: `status` (HttpStatus gives its HTTP status) and, once
// the request was read, its sampling seed (the fresh one it got when it gave none).
struct PreparedReply {
  std::shared_ptr<Reply> reply;  // null when refused
  Status status;
  std::optional<uint64_t> seed;
};

class Reply : public std::enable_shared_from_this<Reply> {
 public:
  // Reads `body` as a request of `api`: its fields only, cheap (what it costs is Build's, which
  // the server runs once the request is admitted). `unique_id` makes the reply's id (the API's
  // prefix + it) and its tool-call ids unique.
  static PreparedReply Read(Api api, const nlohmann::ordered_json& body, const std::string& unique_id,
                            const ReplyContext& context);
  // Builds the request's output constraint (once, within `budget`), renders each choice's prompt
  // and checks that each fits the context and the scheduler's cache budget. Once, before Submit.
  Status Build(const ReplyContext& context, const constrain::CompileBudget& budget = {});
  // Read and Build at once (the reply is null when either refuses).
  static PreparedReply Prepare(Api api, const nlohmann::ordered_json& body, const std::string& unique_id,
                               const ReplyContext& context);
  Reply(const Reply&) = delete;
  Reply& operator=(const Reply&) = delete;

  const std::string& id() const { return id_; }
  bool stream() const { return request_.stream; }
  size_t choice_count() const { return choices_.size(); }

  // On the scheduler's thread (or one that ends queued requests, Scheduler::DropQueued), after
  // each choice has ended and before the writer can see it end; `last` for the request's last.
  using ChoiceEnded = std::function<void(const Status&, const GenerateStats&, size_t largest_batch, bool last)>;
  // Hands every choice to the scheduler (once).
  void Submit(ChoiceEnded on_choice_end);

  // From any thread: the choices stop at their next step (a queued one ends without running) and
  // the reply is written no further (its client left).
  void Cancel() { cancelled_->store(true); }
  // From any thread: as Cancel, and the reply ends with `why` (an error event of a stream; Whole
  // returns it).
  void Stop(const Status& why);

  // The writer's side, from one thread. A stream: waits until events are ready (at most `guard`,
  // so that the writer may check on its client meanwhile) and appends them; true once the stream
  // is complete. The first call returns the events that open it at once.
  bool TakeEvents(std::vector<std::string>* events, std::chrono::milliseconds guard);
  // A whole reply: waits until every choice has ended (at most `guard`); true then.
  bool WaitEnded(std::chrono::milliseconds guard);
  // After WaitEnded: the reply's text, or why there is none.
  StatusOr<std::string> Whole();

 private:
  Reply(Scheduler& scheduler, Api api, std::string id, Request request);
  // Takes what the scheduler handed over since the last call: the choices' new pieces and which
  // choices ended; false after `guard` with nothing.
  bool TakeReady(std::chrono::milliseconds guard, std::vector<std::vector<TurnDelta>>* pieces, std::vector<char>* ended,
                 Status* stopped);

  Scheduler& scheduler_;
  const std::string id_;
  const Api api_;
  const Request request_;
  std::vector<TurnOptions> turns_;  // of each choice, until Submit
  std::unique_ptr<ReplyFormat> format_;
  const std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  std::atomic<size_t> ends_{0};  // choices whose end began (Submit's callbacks)

  // Handed over from the scheduler under mu_: a choice's pieces not taken yet (a stream) or all
  // of them (a whole reply), and how it ended.
  std::mutex mu_;
  std::condition_variable ready_;
  std::vector<ChoiceResult> choices_;
  std::vector<char> ended_;
  size_t finished_ = 0;
  Status stopped_;  // Stop's reason

  // The writer's alone.
  bool opened_ = false;
  std::vector<char> closed_;  // a stream's choices whose end was written
  size_t open_ = 0;           // choices not closed
};

}  // namespace m3
