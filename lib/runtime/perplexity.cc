#include "runtime/perplexity.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "ops/vocab.h"

namespace m3 {

static_assert(std::endian::native == std::endian::little, "log-probability files are little-endian");

StatusOr<std::vector<ScoreWindow>> PlanScoreWindows(size_t n_tokens, size_t context, size_t stride) {
  if (context < 2) return InvalidArgument("the context must hold at least 2 tokens (got ", context, ")");
  if (stride < 1 || stride > context)
    return InvalidArgument("the stride must be 1 to the context (", context, "), got ", stride);
  if (n_tokens < 2) return InvalidArgument("scoring needs at least 2 tokens, got ", n_tokens);
  std::vector<ScoreWindow> windows;
  size_t scored_to = 0;  // the previous window's end
  for (size_t begin = 0;; begin += stride) {
    const size_t end = std::min(begin + context, n_tokens);
    windows.push_back({begin, end, std::max(scored_to, begin + 1)});
    scored_to = end;
    if (end == n_tokens) break;
  }
  return windows;
}

namespace {
Status CheckInVocabulary(std::span<const int32_t> ids, size_t vocab) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= vocab)
      return InvalidArgument("token id ", ids[i], " at index ", i, " is outside the vocabulary [0, ", vocab, ")");
  return Status::Ok();
}
}  // namespace

Status ScoreContinuation(Session& session, std::span<const int32_t> ids,
                         const std::function<bool(size_t, std::span<const float>)>& on_token) {
  const size_t vocab = static_cast<size_t>(session.engine().model().config().vocab_size);
  // The last id is only a target, which the model's own checks never see.
  M3_RETURN_IF_ERROR(CheckInVocabulary(ids, vocab));
  if (ids.size() < 2) return Status::Ok();
  const size_t start = session.position(), rows = ids.size() - 1;
  const size_t chunk = std::max<size_t>(std::min(session.prefill_chunk(), kScoreChunk), 1);
  std::vector<float> logits;
  for (size_t r0 = 0; r0 < rows; r0 += chunk) {
    const size_t n = std::min(chunk, rows - r0);
    if (Status s = session.Eval(ids.subspan(r0, n), LogitsMode::kAllRows, &logits); !s.ok()) {
      (void)session.Rewind(start);  // as Eval leaves it: as it was
      return s;
    }
    for (size_t r = 0; r < n; ++r)
      if (!on_token(r0 + r + 1, std::span<const float>(logits).subspan(r * vocab, vocab))) return Status::Ok();
  }
  return Status::Ok();
}

Status ScoreTokens(Session& session, std::span<const int32_t> ids, std::span<const ScoreWindow> windows,
                   const std::function<bool(size_t, std::span<const float>)>& on_token,
                   const std::function<bool(size_t)>& on_window) {
  M3_RETURN_IF_ERROR(CheckInVocabulary(ids, static_cast<size_t>(session.engine().model().config().vocab_size)));
  for (size_t w = 0; w < windows.size(); ++w) {
    const ScoreWindow& win = windows[w];
    if (win.begin >= win.end || win.first_target <= win.begin || win.first_target > win.end || win.end > ids.size())
      return InvalidArgument("score window ", w, " [", win.begin, ", ", win.end, ") scoring from ", win.first_target,
                             " does not fit ", ids.size(), " tokens");
    M3_RETURN_IF_ERROR(session.Rewind(0));
    // The tokens before the one whose row predicts first_target run without logits.
    const size_t first_row = win.first_target - 1;
    if (first_row > win.begin)
      M3_RETURN_IF_ERROR(session.Eval(ids.subspan(win.begin, first_row - win.begin), LogitsMode::kNone, nullptr));
    bool more = true;
    M3_RETURN_IF_ERROR(ScoreContinuation(session, ids.subspan(first_row, win.end - first_row),
                                         [&](size_t i, std::span<const float> row) {
                                           return more = on_token(first_row + i, row);
                                         }));
    if (!more || (on_window && !on_window(w))) return Status::Ok();
  }
  return Status::Ok();
}

double LogSumExp(std::span<const float> logits) { return LogSumExp(logits.data(), logits.size()); }

void LogSoftmax(std::span<const float> logits, std::vector<float>* out) {
  const double lse = LogSumExp(logits);
  out->resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) (*out)[i] = static_cast<float>(static_cast<double>(logits[i]) - lse);
}

TokenLogprob ScoreToken(std::span<const float> logits, int32_t id, size_t top_n) {
  const double lse = LogSumExp(logits);
  auto lp = [&](size_t i) { return static_cast<float>(static_cast<double>(logits[i]) - lse); };
  TokenLogprob t;
  t.id = id;
  t.logprob = lp(static_cast<size_t>(id));
  // One pass keeping the best top_n (a short sorted list: top_n is small, the vocabulary large).
  top_n = std::min(top_n, logits.size());
  std::vector<int32_t> best;
  best.reserve(top_n + 1);
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  for (size_t i = 0; i < logits.size() && top_n > 0; ++i) {
    const auto v = static_cast<int32_t>(i);
    if (best.size() == top_n && !better(v, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), v, better), v);
    if (best.size() > top_n) best.pop_back();
  }
  for (const int32_t b : best) t.top.emplace_back(b, lp(static_cast<size_t>(b)));
  return t;
}

double KlDivergence(std::span<const float> log_p, std::span<const float> log_q) {
  double kl = 0;
  const size_t n = std::min(log_p.size(), log_q.size());
  for (size_t i = 0; i < n; ++i) {
    const double lp = log_p[i];
    kl += std::exp(lp) * (lp - static_cast<double>(log_q[i]));
  }
  return std::max(0.0, kl);
}

double MeanEstimate::standard_error() const {
  if (n_ < 2) return 0.0;
  const double n = static_cast<double>(n_), m = sum_ / n;
  const double var = std::max(0.0, (sum_sq_ - n * m * m) / (n - 1));
  return std::sqrt(var / n);
}

Status CheckSameScoring(const LogProbFileInfo& file, const LogProbFileInfo& run, const std::string& path) {
  const auto differs = [&](const char* what, uint64_t a, uint64_t b) {
    return InvalidArgument(path, ": the base log-probabilities were computed with ", what, " ", a, ", this run has ",
                           b, "; score the same tokens with the same --context and --stride");
  };
  if (file.vocab != run.vocab) return differs("a vocabulary of", file.vocab, run.vocab);
  if (file.n_ids != run.n_ids) return differs("a token count of", file.n_ids, run.n_ids);
  if (file.ids_hash != run.ids_hash)
    return InvalidArgument(path, ": the base log-probabilities were computed on other tokens (same count, different ids)");
  if (file.context != run.context) return differs("a context of", file.context, run.context);
  if (file.stride != run.stride) return differs("a stride of", file.stride, run.stride);
  if (file.scored != run.scored) return differs("a scored-token count of", file.scored, run.scored);
  return Status::Ok();
}

namespace {

constexpr char kMagic[8] = {'M', '3', 'L', 'O', 'G', 'P', 'R', 'B'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 128;

// magic, version, reserved, then vocab, scored, n_ids, ids_hash, context, stride and the rows' hash
// as uint64; zero padding to 128 bytes.
void EncodeHeader(const LogProbFileInfo& info, uint64_t rows_hash, uint8_t* h) {
  std::memset(h, 0, kHeaderBytes);
  std::memcpy(h, kMagic, 8);
  std::memcpy(h + 8, &kVersion, 4);
  const uint64_t fields[7] = {info.vocab, info.scored, info.n_ids, info.ids_hash, info.context, info.stride, rows_hash};
  std::memcpy(h + 16, fields, sizeof fields);
}

}  // namespace

StatusOr<std::unique_ptr<LogProbFileWriter>> LogProbFileWriter::Create(const std::string& path,
                                                                         const LogProbFileInfo& info) {
  std::unique_ptr<LogProbFileWriter> w(new LogProbFileWriter);
  w->path_ = path;
  w->tmp_ = path + ".tmp";
  w->info_ = info;
  w->f_ = std::fopen(w->tmp_.c_str(), "wb");
  if (!w->f_) return IoError(w->tmp_, ": cannot create: ", std::strerror(errno));
  uint8_t header[kHeaderBytes];
  EncodeHeader(info, 0, header);  // the rows' hash goes in at Finish
  if (std::fwrite(header, 1, kHeaderBytes, w->f_) != kHeaderBytes) return IoError(w->tmp_, ": write failed");
  return w;
}

LogProbFileWriter::~LogProbFileWriter() {
  if (f_) {
    std::fclose(f_);
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }
}

Status LogProbFileWriter::Append(std::span<const float> log_probs) {
  if (!f_) return Internal(path_, ": already finished");
  if (log_probs.size() != info_.vocab)
    return InvalidArgument(path_, ": a row of ", log_probs.size(), " log-probabilities, the file holds ", info_.vocab);
  if (rows_ == info_.scored) return OutOfRange(path_, ": more rows than the ", info_.scored, " declared");
  const size_t bytes = log_probs.size_bytes();
  if (std::fwrite(log_probs.data(), 1, bytes, f_) != bytes) return IoError(tmp_, ": write failed (disk full?)");
  hash_.Update(log_probs.data(), bytes);
  ++rows_;
  return Status::Ok();
}

Status LogProbFileWriter::Finish() {
  if (!f_) return Internal(path_, ": already finished");
  if (rows_ != info_.scored) return Internal(path_, ": ", rows_, " of ", info_.scored, " rows written");
  uint8_t header[kHeaderBytes];
  EncodeHeader(info_, hash_.Digest(), header);
  const bool ok = std::fseek(f_, 0, SEEK_SET) == 0 && std::fwrite(header, 1, kHeaderBytes, f_) == kHeaderBytes &&
                  std::fflush(f_) == 0;
  const bool closed = std::fclose(f_) == 0;
  f_ = nullptr;
  std::error_code ec;
  if (!ok || !closed) {
    std::filesystem::remove(tmp_, ec);
    return IoError(tmp_, ": write failed (disk full?)");
  }
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) {
    std::filesystem::remove(tmp_, ec);
    return IoError(path_, ": cannot rename ", tmp_, " to it: ", ec.message());
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<LogProbFileReader>> LogProbFileReader::Open(const std::string& path) {
  std::unique_ptr<LogProbFileReader> r(new LogProbFileReader);
  r->path_ = path;
  r->f_ = std::fopen(path.c_str(), "rb");
  if (!r->f_) return NotFound(path, ": cannot open: ", std::strerror(errno));
  uint8_t h[kHeaderBytes];
  if (std::fread(h, 1, kHeaderBytes, r->f_) != kHeaderBytes || std::memcmp(h, kMagic, 8) != 0)
    return Corrupt(path, ": not a log-probability file of m3 perplexity --save-base");
  uint32_t version;
  std::memcpy(&version, h + 8, 4);
  if (version != kVersion) return Unsupported(path, ": log-probability file version ", version, ", this m3 reads ", kVersion);
  uint64_t fields[7];
  std::memcpy(fields, h + 16, sizeof fields);
  LogProbFileInfo& i = r->info_;
  i.vocab = fields[0], i.scored = fields[1], i.n_ids = fields[2], i.ids_hash = fields[3], i.context = fields[4],
  i.stride = fields[5], r->expected_hash_ = fields[6];
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  const uint64_t kMaxRows = uint64_t{1} << 40;  // rejects header garbage before multiplying
  if (ec || i.vocab == 0 || i.vocab > kMaxRows || i.scored > kMaxRows / i.vocab ||
      size != kHeaderBytes + i.scored * i.vocab * sizeof(float))
    return Corrupt(path, ": ", ec ? 0 : size, " bytes, the header declares ", i.scored, " rows of ", i.vocab,
                   " log-probabilities (truncated or damaged)");
  return r;
}

LogProbFileReader::~LogProbFileReader() {
  if (f_) std::fclose(f_);
}

Status LogProbFileReader::Next(std::vector<float>* row) {
  if (rows_ == info_.scored) return OutOfRange(path_, ": all ", info_.scored, " rows already read");
  row->resize(info_.vocab);
  const size_t bytes = row->size() * sizeof(float);
  if (std::fread(row->data(), 1, bytes, f_) != bytes) return Corrupt(path_, ": truncated at row ", rows_);
  hash_.Update(row->data(), bytes);
  if (++rows_ == info_.scored && hash_.Digest() != expected_hash_)
    return Corrupt(path_, ": checksum mismatch (the file was changed or damaged)");
  return Status::Ok();
}

}  // namespace m3
