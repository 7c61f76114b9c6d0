#include "runtime/reply.h"

#include <ctime>
#include <utility>

#include "runtime/anthropic.h"
#include "runtime/openai.h"

namespace m3 {
namespace {

using ojson = nlohmann::ordered_json;

StatusOr<Request> ReadRequest(Api api, const ojson& body, const RequestDefaults& defaults) {
  switch (api) {
    case Api::kChatCompletions:
      return openai::ParseChatRequest(body, defaults);
    case Api::kCompletions:
      return openai::ParseCompletionRequest(body, defaults);
    case Api::kMessages:
      return anthropic::ParseMessagesRequest(body, defaults);
  }
  return InvalidArgument("no such API");
}

const char* IdPrefix(Api api) {
  switch (api) {
    case Api::kChatCompletions:
      return "chatcmpl-";
    case Api::kCompletions:
      return "cmpl-";
    case Api::kMessages:
      return "msg_";
  }
  return "";
}

}  // namespace

Reply::Reply(Scheduler& scheduler, Api api, std::string id, Request request)
    : scheduler_(scheduler), id_(std::move(id)), api_(api), request_(std::move(request)) {}

PreparedReply Reply::Read(Api api, const ojson& body, const std::string& unique_id, const ReplyContext& context) {
  PreparedReply out;
  StatusOr<Request> request = ReadRequest(api, body, context.defaults);
  if (!request.ok()) {
    out.status = Status(StatusCode::kInvalidArgument, request.status().message());  // the body's fault
    return out;
  }
  out.seed = request->sampling.seed;
  std::shared_ptr<Reply> reply(
      new Reply(context.scheduler, api, IdPrefix(api) + unique_id, std::move(request).value()));
  const size_t n = ChoiceCount(reply->request_);
  reply->choices_.resize(n);
  reply->turns_.resize(n);
  reply->ended_.assign(n, 0);
  reply->closed_.assign(n, 0);
  reply->open_ = n;
  out.reply = std::move(reply);
  return out;
}

Status Reply::Build(const ReplyContext& context, const constrain::CompileBudget& budget) {
  // The constraint once for every choice and prompt; every choice is checked here, so that even
  // a stream refuses a bad request before it starts.
  M3_ASSIGN_OR_RETURN(const OutputConstraint constraint,
                      BuildConstraint(request_.output, request_.tools, context.text, budget));
  for (size_t c = 0; c < choices_.size(); ++c) {
    M3_ASSIGN_OR_RETURN(std::vector<int32_t> prompt,
                        TurnInputs(context.text, request_, id_, context.scheduler.max_context(), &turns_[c], c,
                                   &constraint));
    // Permanent: a prompt whose cache can never fit the budget is the client's to change (4xx).
    M3_RETURN_IF_ERROR(context.scheduler.CheckFitsBudget(prompt.size()));
    choices_[c].prompt = std::move(prompt);
  }
  if (api_ == Api::kMessages) {
    format_ = anthropic::NewReplyFormat(id_, context.model, choices_[0].prompt.size());
  } else {
    format_ = openai::NewReplyFormat(context.text.tokenizer(), request_, choices_, id_, std::time(nullptr),
                                     context.model);
  }
  return Status::Ok();
}

PreparedReply Reply::Prepare(Api api, const ojson& body, const std::string& unique_id, const ReplyContext& context) {
  PreparedReply out = Read(api, body, unique_id, context);
  if (out.reply) {
    out.status = out.reply->Build(context);
    if (!out.status.ok()) out.reply.reset();
  }
  return out;
}

void Reply::Submit(ChoiceEnded on_choice_end) {
  auto ended = std::make_shared<ChoiceEnded>(std::move(on_choice_end));
  const std::shared_ptr<Reply> self = shared_from_this();
  for (size_t c = 0; c < choices_.size(); ++c) {
    ScheduledRequest sr;
    sr.prompt = choices_[c].prompt;
    sr.turn = std::move(turns_[c]);
    sr.sampling = ChoiceSampling(request_, c);  // seed + c % n
    sr.cancelled = cancelled_;
    sr.on_delta = [self, c](const TurnDelta& d) {
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->choices_[c].deltas.push_back(d);
      }
      self->ready_.notify_all();         // the writer sends it now
      return !self->cancelled_->load();  // a closed connection stops generation
    };
    sr.on_end = [self, c, ended](const Status& status, ParsedOutput out, const GenerateStats& st,
                                 size_t largest_batch) {
      const bool last = self->ends_.fetch_add(1) + 1 == self->choices_.size();
      (*ended)(status, st, largest_batch, last);
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        ChoiceResult& choice = self->choices_[c];
        choice.status = status;
        choice.output = std::move(out);
        choice.stats = st;
        self->ended_[c] = 1;
        ++self->finished_;
      }
      self->ready_.notify_all();
    };
    scheduler_.Submit(std::move(sr));
  }
  turns_.clear();
}

void Reply::Stop(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = why;
  }
  cancelled_->store(true);
  ready_.notify_all();
}

bool Reply::TakeReady(std::chrono::milliseconds guard, std::vector<std::vector<TurnDelta>>* pieces,
                      std::vector<char>* ended, Status* stopped) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] {
    if (!stopped_.ok()) return true;
    for (size_t c = 0; c < choices_.size(); ++c)
      if (!choices_[c].deltas.empty() || (ended_[c] && !closed_[c])) return true;
    return false;
  };
  if (!ready_.wait_for(lock, guard, ready)) return false;
  *stopped = stopped_;
  for (size_t c = 0; c < choices_.size(); ++c) {
    (*pieces)[c].swap(choices_[c].deltas);
    (*ended)[c] = ended_[c];
  }
  return true;
}

bool Reply::TakeEvents(std::vector<std::string>* events, std::chrono::milliseconds guard) {
  if (!opened_) {
    opened_ = true;
    format_->Open(events);
    return false;
  }
  const size_t n = choices_.size();
  std::vector<std::vector<TurnDelta>> pieces(n);
  std::vector<char> ended(n, 0);
  Status stopped;
  if (!TakeReady(guard, &pieces, &ended, &stopped)) return false;
  if (!stopped.ok()) {
    format_->Fail(stopped, events);
    return true;
  }
  for (size_t c = 0; c < n; ++c) {
    for (const TurnDelta& d : pieces[c]) format_->Piece(c, d, events);
    if (!ended[c] || closed_[c]) continue;
    const ChoiceResult& choice = choices_[c];  // ended: the scheduler writes it no more
    if (!choice.status.ok()) {
      cancelled_->store(true);  // one choice failed: the others stop too
      format_->Fail(choice.status, events);
      return true;
    }
    format_->ChoiceEnd(c, choice, events);
    closed_[c] = 1;
    --open_;
  }
  if (open_ > 0) return false;
  format_->Close(choices_, events);
  return true;
}

bool Reply::WaitEnded(std::chrono::milliseconds guard) {
  std::unique_lock<std::mutex> lock(mu_);
  return ready_.wait_for(lock, guard, [&] { return finished_ == choices_.size(); });
}

StatusOr<std::string> Reply::Whole() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_.ok()) return stopped_;
  }
  return format_->Whole(choices_);
}

}  // namespace m3
