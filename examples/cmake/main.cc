// An application of the installed m3 in C++ (m3/m3.hpp over the C API): greedy tokens of a model
// from prompt ids, then one streamed chat turn on a folder with a tokenizer and chat template.
//   m3_cmake_example MODEL_DIR IDS [STEPS]      prints the argmax after the prompt and each step
//   m3_cmake_example --chat MODEL_DIR TEXT      streams the reply to stderr, prints the message JSON
#include <m3/m3.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

int32_t Argmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int Greedy(const std::string& model_dir, const std::string& ids_text, int steps) {
  std::vector<int32_t> ids;
  std::stringstream in(ids_text);
  for (std::string id; std::getline(in, id, ',');) ids.push_back(std::stoi(id));
  m3api::Engine engine(model_dir);
  m3api::Session session(engine);
  std::vector<float> logits = session.Eval(ids);
  for (int step = 0; step <= steps; ++step) {
    const int32_t next = Argmax(logits);
    std::cout << (step ? " " : "") << next;
    if (step < steps) logits = session.Eval({next});
  }
  std::cout << "\n";
  return 0;
}

int Chat(const std::string& model_dir, const std::string& text) {
  m3api::Engine engine(model_dir);
  m3api::Tokenizer tokenizer(model_dir);
  m3api::Session session(engine);
  m3_generate_options options = m3api::DefaultGenerateOptions();
  options.max_tokens = 16;
  options.seed = 7;
  std::string escaped;
  for (char c : text) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
  }
  const std::string request = "{\"messages\": [{\"role\": \"user\", \"content\": \"" + escaped +
                              "\"}], \"options\": {\"thinking_mode\": \"disabled\"}}";
  const std::string message = session.Chat(tokenizer, request, options, [](m3_chat_part, std::string_view piece) {
    std::cerr << piece;
    return true;
  });
  std::cout << message << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 4 && std::string(argv[1]) == "--chat") return Chat(argv[2], argv[3]);
    if (argc == 3 || argc == 4) return Greedy(argv[1], argv[2], argc == 4 ? std::stoi(argv[3]) : 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "m3_cmake_example: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s MODEL_DIR IDS [STEPS] | --chat MODEL_DIR TEXT\n", argv[0]);
  return 2;
}
