// An independent JSON-schema validator for the constrained-decoding tests: it checks a value
// against the keywords directly (no grammar), so the grammar's output is judged by other code.
// Covers the subset lib/constrain supports; returns "" when valid, else the first failure.
#pragma once

#include <cmath>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

namespace m3::test {

class SchemaCheck {
 public:
  explicit SchemaCheck(const nlohmann::json& root) : root_(root) {}

  std::string Validate(const nlohmann::json& v) const { return Check(v, root_, "", 0); }

 private:
  using json = nlohmann::json;

  static size_t CodePoints(const std::string& s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
  }

  static bool ValidUtf8(const std::string& s) {
    size_t i = 0;
    while (i < s.size()) {
      const auto c = static_cast<unsigned char>(s[i]);
      int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
      if (n == 0 || i + n > s.size()) return false;
      uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
      for (int k = 1; k < n; ++k) {
        const auto cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xC0) != 0x80) return false;
        cp = (cp << 6) | (cc & 0x3F);
      }
      static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
      if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
      i += n;
    }
    return true;
  }

  static bool Digits(const std::string& s, size_t pos, size_t n) {
    if (pos + n > s.size()) return false;
    for (size_t i = pos; i < pos + n; ++i) {
      if (s[i] < '0' || s[i] > '9') return false;
    }
    return true;
  }
  static int Num(const std::string& s, size_t pos, size_t n) { return std::stoi(s.substr(pos, n)); }

  static bool IsDate(const std::string& s) {
    if (s.size() != 10 || s[4] != '-' || s[7] != '-' || !Digits(s, 0, 4) || !Digits(s, 5, 2) || !Digits(s, 8, 2)) return false;
    const int y = Num(s, 0, 4), m = Num(s, 5, 2), d = Num(s, 8, 2);
    static const int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1) return false;
    const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    return d <= kDays[m - 1] + (m == 2 && leap ? 1 : 0);
  }

  static bool IsTime(const std::string& s) {
    if (s.size() < 9 || s[2] != ':' || s[5] != ':' || !Digits(s, 0, 2) || !Digits(s, 3, 2) || !Digits(s, 6, 2)) return false;
    if (Num(s, 0, 2) > 23 || Num(s, 3, 2) > 59 || Num(s, 6, 2) > 60) return false;
    size_t i = 8;
    if (s[i] == '.') {
      size_t j = i + 1;
      while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
      if (j == i + 1) return false;
      i = j;
    }
    if (i < s.size() && (s[i] == 'Z' || s[i] == 'z')) return i + 1 == s.size();
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) {
      return s.size() == i + 6 && Digits(s, i + 1, 2) && s[i + 3] == ':' && Digits(s, i + 4, 2) &&
             Num(s, i + 1, 2) <= 23 && Num(s, i + 4, 2) <= 59;
    }
    return false;
  }

  static bool IsFormat(const std::string& f, const std::string& s) {
    if (f == "date") return IsDate(s);
    if (f == "time") return IsTime(s);
    if (f == "date-time") {
      const size_t t = s.find_first_of("Tt");
      return t == 10 && IsDate(s.substr(0, 10)) && IsTime(s.substr(11));
    }
    if (f == "uuid") {
      if (s.size() != 36) return false;
      for (size_t i = 0; i < 36; ++i) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
          if (s[i] != '-') return false;
        } else if (!std::isxdigit(static_cast<unsigned char>(s[i]))) {
          return false;
        }
      }
      return true;
    }
    if (f == "email") {
      const size_t at = s.find('@');
      if (at == std::string::npos || at == 0 || s.find('@', at + 1) != std::string::npos) return false;
      const std::string local = s.substr(0, at), domain = s.substr(at + 1);
      if (local.front() == '.' || local.back() == '.' || local.find("..") != std::string::npos) return false;
      if (domain.find('.') == std::string::npos || domain.front() == '.' || domain.back() == '.' ||
          domain.find("..") != std::string::npos) {
        return false;
      }
      for (char c : domain) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') return false;
      }
      for (char c : local) {
        if (static_cast<unsigned char>(c) <= 0x20 || std::string("()<>[]:;@\\,\"").find(c) != std::string::npos) return false;
      }
      return true;
    }
    if (f == "ipv4") {
      int parts = 0;
      size_t i = 0;
      while (true) {
        size_t j = i;
        while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
        if (j == i || j - i > 3 || (j - i > 1 && s[i] == '0') || std::stoi(s.substr(i, j - i)) > 255) return false;
        ++parts;
        if (j == s.size()) break;
        if (s[j] != '.') return false;
        i = j + 1;
      }
      return parts == 4;
    }
    return false;
  }

  const json& Resolve(const std::string& ref) const {
    if (ref == "#") return root_;
    for (const std::string pre : {"#/$defs/", "#/definitions/"}) {
      if (ref.rfind(pre, 0) == 0) return root_[pre.substr(2, pre.size() - 3)][ref.substr(pre.size())];
    }
    static const json kNone;
    return kNone;
  }

  static bool TypeIs(const json& v, const std::string& t) {
    if (t == "string") return v.is_string();
    if (t == "integer") return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
    if (t == "number") return v.is_number();
    if (t == "boolean") return v.is_boolean();
    if (t == "null") return v.is_null();
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    return false;
  }

  std::string Check(const json& v, const json& s, const std::string& at, int depth) const {
    if (depth > 200) return at + ": too deep";
    if (s.is_boolean()) return s.get<bool>() ? "" : at + ": schema false";
    if (!s.is_object()) return at + ": bad schema";
    if (s.contains("$ref")) return Check(v, Resolve(s["$ref"].get<std::string>()), at, depth + 1);
    if (s.contains("type")) {
      bool ok = false;
      if (s["type"].is_array()) {
        for (const json& t : s["type"]) ok = ok || TypeIs(v, t.get<std::string>());
      } else {
        ok = TypeIs(v, s["type"].get<std::string>());
      }
      if (!ok) return at + ": type " + s["type"].dump() + " but " + v.dump();
    }
    if (s.contains("const") && !(s["const"] == v)) return at + ": const";
    if (s.contains("enum")) {
      bool ok = false;
      for (const json& e : s["enum"]) ok = ok || e == v;
      if (!ok) return at + ": not in enum: " + v.dump();
    }
    if (s.contains("anyOf")) {
      bool ok = false;
      for (const json& m : s["anyOf"]) ok = ok || Check(v, m, at, depth + 1).empty();
      if (!ok) return at + ": no anyOf member matches " + v.dump();
    }
    if (s.contains("oneOf")) {
      int n = 0;
      for (const json& m : s["oneOf"]) n += Check(v, m, at, depth + 1).empty();
      if (n != 1) return at + ": " + std::to_string(n) + " oneOf members match " + v.dump();
    }
    if (s.contains("allOf")) {
      for (const json& m : s["allOf"]) {
        if (std::string e = Check(v, m, at, depth + 1); !e.empty()) return e;
      }
    }
    if (v.is_string()) {
      const std::string& str = v.get_ref<const std::string&>();
      if (!ValidUtf8(str)) return at + ": invalid UTF-8";
      const size_t n = CodePoints(str);
      if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return at + ": shorter than minLength";
      if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return at + ": longer than maxLength";
      if (s.contains("pattern") && !std::regex_search(str, std::regex(s["pattern"].get<std::string>(), std::regex::ECMAScript))) {
        return at + ": does not match pattern: " + v.dump();
      }
      if (s.contains("format") && !IsFormat(s["format"].get<std::string>(), str)) {
        return at + ": not a " + s["format"].get<std::string>() + ": " + v.dump();
      }
    }
    if (v.is_number()) {
      const double x = v.get<double>();
      if (!std::isfinite(x)) return at + ": not finite";
      if (s.contains("minimum") && x < s["minimum"].get<double>()) return at + ": below minimum: " + v.dump();
      if (s.contains("maximum") && x > s["maximum"].get<double>()) return at + ": above maximum: " + v.dump();
      if (s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_number() && x <= s["exclusiveMinimum"].get<double>()) {
        return at + ": not above exclusiveMinimum";
      }
      if (s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_number() && x >= s["exclusiveMaximum"].get<double>()) {
        return at + ": not below exclusiveMaximum";
      }
    }
    if (v.is_object()) {
      const json props = s.value("properties", json::object());
      for (const json& r : s.value("required", json::array())) {
        if (!v.contains(r.get<std::string>())) return at + ": missing required " + r.dump();
      }
      for (auto& [k, sub] : v.items()) {
        const std::string kat = at + "/" + k;
        if (props.contains(k)) {
          if (std::string e = Check(sub, props[k], kat, depth + 1); !e.empty()) return e;
        } else if (s.contains("additionalProperties")) {
          if (std::string e = Check(sub, s["additionalProperties"], kat, depth + 1); !e.empty()) return e;
        }
      }
    }
    if (v.is_array()) {
      const size_t n = v.size();
      if (s.contains("minItems") && n < s["minItems"].get<size_t>()) return at + ": fewer than minItems";
      if (s.contains("maxItems") && n > s["maxItems"].get<size_t>()) return at + ": more than maxItems";
      size_t prefix = 0;
      if (s.contains("prefixItems")) {
        prefix = s["prefixItems"].size();
        for (size_t i = 0; i < std::min(n, prefix); ++i) {
          if (std::string e = Check(v[i], s["prefixItems"][i], at + "/" + std::to_string(i), depth + 1); !e.empty()) return e;
        }
      }
      if (s.contains("items")) {
        for (size_t i = prefix; i < n; ++i) {
          if (std::string e = Check(v[i], s["items"], at + "/" + std::to_string(i), depth + 1); !e.empty()) return e;
        }
      }
    }
    return "";
  }

  const json& root_;
};

}  // namespace m3::test
