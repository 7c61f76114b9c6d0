// Progress of a long job counted in bytes (m3 pack, the benchmark model generator) or tokens
// (m3 perplexity): when to redraw and what to draw. It formats only; the caller prints (the library never does).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace m3 {

class ProgressMeter {
 public:
  // tty: redraw one line in place at most every 100 ms; otherwise one line per 10%.
  enum class Unit { kBytes, kTokens };
  ProgressMeter(std::string label, uint64_t total, bool tty, Unit unit = Unit::kBytes)
      : label_(std::move(label)), total_(total), tty_(tty), unit_(unit), start_(Clock::now()), last_(start_) {}

  // The text to print after `done` of `total` bytes, or "" when nothing is due. On a terminal it
  // starts with '\r' and only the final line ends with '\n'.
  std::string Update(uint64_t done) {
    done = std::min(done, total_);
    const auto now = Clock::now();
    const bool finished = done >= total_;
    const double pct = total_ ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100.0;
    if (tty_) {
      if (!finished && now - last_ < std::chrono::milliseconds(100)) return "";
    } else {
      const int decile = static_cast<int>(pct / 10);
      if (decile <= last_decile_) return "";
      last_decile_ = decile;
    }
    last_ = now;
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;  // units/s
    const std::string eta = rate > 0 && !finished ? Duration(static_cast<double>(total_ - done) / rate) : "0s";
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(pct / 100 * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '.');
    const bool bytes = unit_ == Unit::kBytes;
    const double scale = bytes ? 1e6 : 1;
    char line[256];
    std::snprintf(line, sizeof line, "%s%s[%s] %5.1f%%  %8.*f / %.*f %s  %7.1f %s  ETA %s%s", tty_ ? "\r" : "",
                  label_.c_str(), bar.c_str(), pct, bytes ? 1 : 0, static_cast<double>(done) / scale, bytes ? 1 : 0,
                  static_cast<double>(total_) / scale, bytes ? "MB" : "tokens", rate / scale, bytes ? "MB/s" : "tok/s",
                  eta.c_str(), tty_ && !finished ? "   " : "\n");
    return line;
  }

  static std::string Duration(double s) {
    char buf[32];
    if (s < 60)
      std::snprintf(buf, sizeof buf, "%.0fs", s);
    else if (s < 3600)
      std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
    else
      std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600, static_cast<int>(s) % 3600 / 60);
    return buf;
  }

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  uint64_t total_;
  bool tty_;
  Unit unit_;
  Clock::time_point start_, last_;
  int last_decile_ = -1;
};

}  // namespace m3
