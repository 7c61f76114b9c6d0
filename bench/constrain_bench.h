// `m3 bench --constrain`: the per-token cost of constrained decoding (lib/constrain) over the real
// vocabulary. For an agent-style tool schema (nested objects, enums, arrays, strings, bounded
// numbers), compiled as a JSON schema and as M3 tool-call markup, seeded random walks (a model
// that picks uniformly among the allowed tokens, budget 512) time every Matcher::FillMask:
//
//   cold    the step walked the vocabulary trie (a parse state this matcher had not seen)
//   cached  the step's mask came from the matcher's cache (lookup + copy of 25 KB)
//   all     every step; mean, p50, p99 and max in microseconds
//
// plus the one-off costs: VocabIndex::Build (per tokenizer) and the grammar compile (per schema).
// One thread (a mask is per request). Compare `all.mean` with a decode step (tens of ms on CPU).
#pragma once

#include <cstdio>
#include <string>

#include "runtime/engine.h"

namespace m3::bench {

struct ConstrainBenchOptions {
  std::string tokenizer;  // tokenizer.json or its folder
  int walks = 8;          // random walks per grammar
  size_t budget = 512;    // tokens per walk
  bool json = false;      // JSON lines instead of the table
  // -m DIR: a model whose decode step (median of single-token steps) the masks are set against;
  // empty: none.
  std::string model_dir;
  EngineOptions engine;
};

// Returns 0, or 1 when the tokenizer or a grammar cannot be loaded or a walk breaks the grammar.
int RunConstrainBench(const ConstrainBenchOptions& options, FILE* out, FILE* log);

}  // namespace m3::bench
