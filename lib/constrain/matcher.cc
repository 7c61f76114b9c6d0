// The matcher: a set of parse stacks over the grammar's flat element array, advanced byte by
// byte. Stacks live in a per-matcher arena of interned frames (position, parent), so a stack is
// one node id and equal stacks are equal ids; a parse state is the sorted set of its stacks'
// top nodes, interned too. Transitions (state, byte) -> state are memoized: a lazy DFA. A mask
// is one preorder walk of the vocabulary trie that follows those transitions and skips a subtree
// at the first dead byte; it is cached per state, so a repeated state (inside a long string,
// between properties) costs a lookup and a 25 KB copy.
//
// The budget: each node carries the fewest bytes that complete the grammar from it (the
// grammar's suffix minima summed down the stack), so a state knows its minimal completion.
// Every byte is a token of the byte-level vocabulary, so that many tokens always suffice.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "constrain/constrain.h"
#include "constrain/grammar.h"

namespace m3::constrain {
namespace {

constexpr int32_t kDead = -1;
constexpr int32_t kUnknown = -2;
constexpr int32_t kCompleteTop = -1;  // in a state's tops: the empty stack (grammar complete)
// Bounds on one state: stacks nested deeper than kMaxDepth frames are not followed (JSON nested
// ~250 deep), a state with more than kMaxStacks stacks is treated as dead, and one transition
// expands at most kMaxExpandSteps positions. Schema grammars stay under ~10 stacks; only highly
// ambiguous GBNF reaches these (fuzz_grammar found recursions that grow a stack per byte), and
// there a cold mask can still take long: the bounds cap its memory, not its time.
constexpr uint32_t kMaxDepth = 512;
constexpr size_t kMaxStacks = 1024;
constexpr size_t kMaxExpandSteps = 50'000;
// Caches are dropped (and the current state re-interned) past these sizes.
constexpr size_t kMaxNodes = 1 << 20;
constexpr size_t kMaxStates = 1 << 15;
constexpr size_t kMaxCachedMasks = 96;  // ~2.4 MB of masks at 200K tokens

struct VecHash {
  size_t operator()(const std::vector<int32_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int32_t x : v) h = (h ^ static_cast<uint32_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

}  // namespace

struct Matcher::Impl {
  std::shared_ptr<const Grammar> g;
  std::shared_ptr<const VocabIndex> v;
  std::vector<int32_t> end_ids;

  struct Node {
    uint32_t pos;
    int32_t parent;
    uint32_t depth;
    uint32_t rest;  // fewest bytes to complete the grammar from here (this frame and below)
  };
  std::vector<Node> nodes;
  std::unordered_map<uint64_t, int32_t> node_ids;
  const char* bound_passed = nullptr;  // the bound that made the latest state dead, if one did

  struct State {
    std::vector<int32_t> tops;
    int32_t trans = -1;  // offset of its 256 transitions in `trans`, -1 until needed
    uint32_t min = 0;
    bool complete = false;
    bool has_tokens = false;
    std::string shared_key;  // the grammar's shared-mask key, made when first needed
  };
  std::vector<State> states;
  std::unordered_map<std::vector<int32_t>, int32_t, VecHash> state_ids;
  std::vector<int32_t> trans;
  std::unordered_map<uint64_t, int32_t> token_trans;

  using CachedMask = TokenMask;
  std::unordered_map<uint64_t, std::shared_ptr<const TokenMask>> masks;

  int32_t cur = kDead;
  bool done = false;
  size_t expand_steps = 0;
  std::vector<int32_t> scratch, walk;
  Stats stats;

  Impl(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabIndex> vocab, std::vector<int32_t> ends)
      : g(std::move(grammar)), v(std::move(vocab)), end_ids(std::move(ends)) {}

  void Reset() {
    nodes.clear();
    node_ids.clear();
    states.clear();
    state_ids.clear();
    trans.clear();
    token_trans.clear();
    masks.clear();
  }

  int32_t Intern(uint32_t pos, int32_t parent) {
    const uint64_t key = (uint64_t{pos} << 32) | static_cast<uint32_t>(parent + 1);
    auto it = node_ids.find(key);
    if (it != node_ids.end()) return it->second;
    const uint32_t depth = parent < 0 ? 1 : nodes[parent].depth + 1;
    if (depth > kMaxDepth) {
      bound_passed = "its rules nest deeper than 512 at one position";
      return kDead;
    }
    const uint64_t rest = uint64_t{g->suffix_min(pos)} + (parent < 0 ? 0 : nodes[parent].rest);
    const auto id = static_cast<int32_t>(nodes.size());
    nodes.push_back({pos, parent, depth, static_cast<uint32_t>(std::min<uint64_t>(rest, kInfiniteLength))});
    node_ids.emplace(key, id);
    return id;
  }

  // Every stack reached from position `pos` (continuing with `parent`) by expanding rule
  // references and finished alternatives until a terminal is on top.
  void Expand(uint32_t pos, int32_t parent, std::vector<int32_t>& out) {
    if (++expand_steps > kMaxExpandSteps) {
      bound_passed = "one position expands to over 50,000 grammar positions";
      return;
    }
    const Element& e = g->elements()[pos];
    switch (e.kind) {
      case Element::kEnd:
        if (parent < 0) {
          out.push_back(kCompleteTop);
        } else {
          const Node p = nodes[parent];
          Expand(p.pos, p.parent, out);
        }
        return;
      case Element::kBytes:
      case Element::kToken: {
        const int32_t id = Intern(pos, parent);
        if (id >= 0) out.push_back(id);
        return;
      }
      case Element::kRef: {
        int32_t frame = parent;
        if (g->elements()[pos + 1].kind != Element::kEnd) {  // a tail call pushes nothing
          frame = Intern(pos + 1, parent);
          if (frame < 0) return;
        }
        for (uint32_t alt : g->alternatives(e.arg)) Expand(alt, frame, out);
        return;
      }
    }
  }

  int32_t InternState(std::vector<int32_t>& tops) {
    if (expand_steps > kMaxExpandSteps) return kDead;
    std::sort(tops.begin(), tops.end());
    tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
    if (tops.size() > kMaxStacks) bound_passed = "one position opens more than 1,024 parse stacks at once";
    if (tops.empty() || tops.size() > kMaxStacks) return kDead;
    auto it = state_ids.find(tops);
    if (it != state_ids.end()) return it->second;
    State s;
    s.tops = tops;
    uint32_t min = kInfiniteLength;
    for (int32_t t : tops) {
      if (t == kCompleteTop) {
        s.complete = true;
        min = 0;
        continue;
      }
      min = std::min(min, nodes[t].rest);
      if (g->elements()[nodes[t].pos].kind == Element::kToken) s.has_tokens = true;
    }
    s.min = min;
    const auto id = static_cast<int32_t>(states.size());
    states.push_back(std::move(s));
    state_ids.emplace(tops, id);
    return id;
  }

  int32_t Initial() {
    expand_steps = 0;
    std::vector<int32_t> tops;
    for (uint32_t alt : g->alternatives(g->root())) Expand(alt, -1, tops);
    return InternState(tops);
  }

  int32_t Advance(int32_t s, uint8_t b) {
    expand_steps = 0;
    scratch.clear();
    const std::vector<int32_t> tops = states[s].tops;  // (states may grow below)
    for (int32_t t : tops) {
      if (t == kCompleteTop) continue;
      const Node n = nodes[t];
      const Element& e = g->elements()[n.pos];
      if (e.kind == Element::kBytes && Has(g->byte_sets()[e.arg], b)) Expand(n.pos + 1, n.parent, scratch);
    }
    return InternState(scratch);
  }

  int32_t Trans(int32_t s, uint8_t b) {
    if (states[s].trans < 0) {
      states[s].trans = static_cast<int32_t>(trans.size());
      trans.resize(trans.size() + 256, kUnknown);
    }
    int32_t r = trans[states[s].trans + b];
    if (r != kUnknown) return r;
    r = Advance(s, b);
    trans[states[s].trans + b] = r;
    return r;
  }

  int32_t AdvanceToken(int32_t s, int32_t id) {
    if (!states[s].has_tokens) return kDead;
    const uint64_t key = (uint64_t(uint32_t(s)) << 32) | uint32_t(id);
    auto it = token_trans.find(key);
    if (it != token_trans.end()) return it->second;
    expand_steps = 0;
    scratch.clear();
    const std::vector<int32_t> tops = states[s].tops;
    for (int32_t t : tops) {
      if (t == kCompleteTop) continue;
      const Node n = nodes[t];
      const Element& e = g->elements()[n.pos];
      if (e.kind == Element::kToken && e.arg == static_cast<uint32_t>(id)) Expand(n.pos + 1, n.parent, scratch);
    }
    const int32_t r = InternState(scratch);
    token_trans.emplace(key, r);
    return r;
  }

  bool IsEnd(int32_t id) const { return std::find(end_ids.begin(), end_ids.end(), id) != end_ids.end(); }

  // The stacks of state `s` as position chains (top first), to carry a state across a reset.
  std::vector<std::vector<uint32_t>> Chains(int32_t s) const {
    std::vector<std::vector<uint32_t>> chains;
    for (int32_t t : states[s].tops) {
      std::vector<uint32_t> chain;
      for (int32_t n = t; n >= 0; n = nodes[n].parent) chain.push_back(nodes[n].pos);
      chains.push_back(std::move(chain));  // empty: the complete stack
    }
    return chains;
  }

  int32_t Import(const std::vector<std::vector<uint32_t>>& chains) {
    std::vector<int32_t> tops;
    for (const auto& chain : chains) {
      if (chain.empty()) {
        tops.push_back(kCompleteTop);
        continue;
      }
      int32_t parent = -1;
      for (size_t i = chain.size(); i-- > 0;) parent = Intern(chain[i], parent);
      tops.push_back(parent);
    }
    expand_steps = 0;
    return InternState(tops);
  }

  void MaybeShrink() {
    if (nodes.size() <= kMaxNodes && states.size() <= kMaxStates) return;
    const auto chains = Chains(cur);
    Reset();
    cur = Import(chains);
  }

  // Text tokens by the trie walk, then special tokens, then the end ids. `limit`: the largest
  // minimal completion allowed after a token (kInfiniteLength: no budget).
  void Compute(int32_t s, uint32_t limit, CachedMask& out) {
    ++stats.trie_walks;
    const VocabIndex& vi = *v;
    out.bits.assign((vi.vocab_size() + 63) / 64, 0);
    out.max_after = 0;
    uint64_t* bits = out.bits.data();
    walk.resize(vi.max_depth_ + 1);
    walk[0] = s;
    const size_t n = vi.byte_.size();
    const uint8_t* byte = vi.byte_.data();
    const uint16_t* depth = vi.depth_.data();
    const uint32_t* skip = vi.skip_.data();
    const int32_t* token = vi.token_.data();
    for (size_t i = 0; i < n;) {
      const int32_t from = walk[depth[i] - 1];
      const int32_t base = states[from].trans;
      int32_t next = base >= 0 ? trans[base + byte[i]] : kUnknown;
      if (next == kUnknown) next = Trans(from, byte[i]);
      if (next < 0) {
        i = skip[i];
        continue;
      }
      walk[depth[i]] = next;
      const int32_t id = token[i];
      if (id >= 0) {
        const uint32_t m = states[next].min;
        if (m <= limit) {
          bits[id >> 6] |= uint64_t{1} << (id & 63);
          out.max_after = std::max(out.max_after, m);
        }
      }
      ++i;
    }
    for (auto [primary, dup] : vi.duplicates_) {
      if ((bits[primary >> 6] >> (primary & 63)) & 1) bits[dup >> 6] |= uint64_t{1} << (dup & 63);
    }
    if (states[s].has_tokens) {
      const std::vector<int32_t> tops = states[s].tops;
      for (int32_t t : tops) {
        if (t == kCompleteTop) continue;
        const Element& e = g->elements()[nodes[t].pos];
        if (e.kind != Element::kToken || e.arg >= vi.vocab_size()) continue;
        const auto id = static_cast<int32_t>(e.arg);
        const int32_t next = AdvanceToken(s, id);
        if (next < 0 || states[next].min > limit) continue;
        bits[id >> 6] |= uint64_t{1} << (id & 63);
        out.max_after = std::max(out.max_after, states[next].min);
      }
    }
    if (states[s].complete) {
      for (int32_t id : end_ids) {
        if (id >= 0 && static_cast<size_t>(id) < vi.vocab_size()) bits[id >> 6] |= uint64_t{1} << (id & 63);
      }
    }
  }

  // The state's stacks as grammar positions (what makes two matchers' states the same), with
  // the vocabulary and the end ids; empty for a state too large to be worth sharing.
  const std::string& SharedKey(int32_t s) {
    State& st = states[s];
    if (!st.shared_key.empty()) return st.shared_key;
    std::string key;
    auto put = [&key](uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); };
    put(v->uid_);
    put(end_ids.size());
    for (int32_t id : end_ids) put(static_cast<uint32_t>(id));
    for (int32_t t : st.tops) {
      put(~uint64_t{0});
      for (int32_t n = t; n >= 0; n = nodes[n].parent) put(nodes[n].pos);
      if (key.size() > (1 << 16)) return st.shared_key;  // (left empty: not shared)
    }
    st.shared_key = std::move(key);
    return st.shared_key;
  }

  std::shared_ptr<const TokenMask> Mask(int32_t s, uint32_t limit) {
    ++stats.masks;
    const uint64_t key = (uint64_t(uint32_t(s)) << 32) | (limit == kInfiniteLength ? 0 : uint64_t{limit} + 1);
    auto it = masks.find(key);
    if (it != masks.end()) {
      ++stats.cached;
      return it->second;
    }
    if (masks.size() >= kMaxCachedMasks) masks.clear();
    std::string shared = SharedKey(s);
    std::shared_ptr<const TokenMask> m;
    if (!shared.empty()) {
      shared.append(reinterpret_cast<const char*>(&limit), sizeof limit);
      m = g->FindMask(shared);
      if (m) ++stats.shared;
    }
    if (!m) {
      auto fresh = std::make_shared<TokenMask>();
      Compute(s, limit, *fresh);
      m = std::move(fresh);
      if (!shared.empty()) g->StoreMask(shared, m);
    }
    masks.emplace(key, m);
    return m;
  }
};

Matcher::Matcher(std::shared_ptr<const Grammar> g, std::shared_ptr<const VocabIndex> v, std::vector<int32_t> end_ids)
    : impl_(std::make_unique<Impl>(std::move(g), std::move(v), std::move(end_ids))) {
  impl_->cur = impl_->Initial();
}
Matcher::Matcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Matcher::~Matcher() = default;
Matcher::Matcher(Matcher&&) noexcept = default;
Matcher& Matcher::operator=(Matcher&&) noexcept = default;

Matcher Matcher::Clone() const {
  auto copy = std::make_unique<Impl>(impl_->g, impl_->v, impl_->end_ids);
  copy->done = impl_->done;
  copy->cur = impl_->cur < 0 ? impl_->cur : copy->Import(impl_->Chains(impl_->cur));
  return Matcher(std::move(copy));
}

size_t Matcher::mask_words() const { return (impl_->v->vocab_size() + 63) / 64; }

void Matcher::FillMask(std::span<uint64_t> mask, size_t tokens_left) {
  Impl& m = *impl_;
  std::fill(mask.begin(), mask.end(), 0);
  const size_t vocab = m.v->vocab_size();
  auto set_ends = [&] {
    for (int32_t id : m.end_ids) {
      if (id >= 0 && static_cast<size_t>(id) < vocab && static_cast<size_t>(id) / 64 < mask.size()) {
        mask[id / 64] |= uint64_t{1} << (id & 63);
      }
    }
  };
  if (m.done || m.cur < 0) {
    set_ends();  // nothing may follow; an end id keeps the mask non-empty
    return;
  }
  m.MaybeShrink();
  if (tokens_left < 1) tokens_left = 1;
  std::shared_ptr<const TokenMask> chosen = m.Mask(m.cur, kInfiniteLength);
  // A token is allowed when its minimal completion plus the end id fits in what is left after it.
  // Only when the budget is that tight is a second, budgeted walk made (and cached per budget).
  if (chosen->max_after + 2 > tokens_left) {
    if (tokens_left < 2) {
      if (m.states[m.cur].complete) return set_ends();  // only the end id fits
    } else {
      const auto limit = static_cast<uint32_t>(std::min<size_t>(tokens_left - 2, kInfiniteLength - 1));
      std::shared_ptr<const TokenMask> tight = m.Mask(m.cur, limit);
      bool any = false;
      for (uint64_t w : tight->bits) any = any || w != 0;
      // Nothing fits only below MinTokens() (the caller asked for too little): no budget then.
      if (any) chosen = std::move(tight);
    }
  }
  const size_t words = std::min(mask.size(), chosen->bits.size());
  std::memcpy(mask.data(), chosen->bits.data(), words * sizeof(uint64_t));
  if (vocab % 64 != 0 && words == chosen->bits.size()) mask[words - 1] &= (uint64_t{1} << (vocab % 64)) - 1;
  bool any = false;
  for (size_t i = 0; i < words && !any; ++i) any = mask[i] != 0;
  if (!any) set_ends();
}

bool Matcher::Accept(int32_t id) {
  Impl& m = *impl_;
  if (m.done || m.cur < 0 || id < 0 || static_cast<size_t>(id) >= m.v->vocab_size()) return false;
  m.MaybeShrink();
  if (m.IsEnd(id)) {
    // Allowed when the grammar is complete, and at a dead end (a state whose every continuation
    // passes the stack bounds, only in pathological grammars) so that the mask is never empty.
    bool dead_end = false;
    if (!m.states[m.cur].complete) {
      const auto full = m.Mask(m.cur, kInfiniteLength);
      const auto& bits = full->bits;
      dead_end = std::all_of(bits.begin(), bits.end(), [](uint64_t w) { return w == 0; });
    }
    if (m.states[m.cur].complete || dead_end) {
      m.done = true;
      return true;
    }
  }
  int32_t s = m.cur;
  if (m.v->is_text_token(id)) {
    for (char c : m.v->token_bytes(id)) {
      s = m.Trans(s, static_cast<uint8_t>(c));
      if (s < 0) break;
    }
  } else {
    s = kDead;
  }
  // A <[id]> terminal may name a text token too: then either reading counts (their union).
  const int32_t by_id = m.AdvanceToken(m.cur, id);
  if (s >= 0 && by_id >= 0 && s != by_id) {
    std::vector<int32_t> tops = m.states[s].tops;
    tops.insert(tops.end(), m.states[by_id].tops.begin(), m.states[by_id].tops.end());
    m.expand_steps = 0;
    s = m.InternState(tops);
  } else if (s < 0) {
    s = by_id;
  }
  if (s < 0) return false;
  m.cur = s;
  return true;
}

bool Matcher::complete() const { return impl_->done || (impl_->cur >= 0 && impl_->states[impl_->cur].complete); }
bool Matcher::done() const { return impl_->done; }

Status Matcher::StartStatus() const {
  if (impl_->done || impl_->cur >= 0) return Status::Ok();
  return InvalidArgument("the grammar is past what the constrained decoder follows: ",
                         impl_->bound_passed ? impl_->bound_passed : "no text matches it",
                         " (write a long alternation or an ambiguous repetition as nested rules)");
}

size_t Matcher::MinTokens() const {
  if (impl_->done) return 0;
  if (impl_->cur < 0) return kInfiniteLength;
  return size_t{impl_->states[impl_->cur].min} + 1;
}

void Matcher::ApplyMask(std::span<float> logits, size_t tokens_left) {
  std::vector<uint64_t> mask(mask_words());
  FillMask(mask, tokens_left);
  const size_t vocab = impl_->v->vocab_size();
  for (size_t i = 0; i < logits.size(); ++i) {
    if (i >= vocab || !((mask[i >> 6] >> (i & 63)) & 1)) logits[i] = -std::numeric_limits<float>::infinity();
  }
}

Matcher::Stats Matcher::stats() const {
  Stats s = impl_->stats;
  s.dfa_states = impl_->states.size();
  s.stack_nodes = impl_->nodes.size();
  return s;
}

Status CheckGrammarTokens(const Grammar& g, const VocabIndex& v) {
  for (int32_t id : g.token_ids()) {
    if (id < 0 || static_cast<size_t>(id) >= v.vocab_size()) {
      return InvalidArgument("grammar: token <[", id, "]> is not in the vocabulary (", v.vocab_size(), " tokens)");
    }
  }
  return Status::Ok();
}

// --- VocabIndex ---------------------------------------------------------------------------

std::shared_ptr<const VocabIndex> VocabIndex::Build(const Tokenizer& tokenizer) {
  auto v = std::make_shared<VocabIndex>();
  static std::atomic<uint64_t> next_uid{1};
  v->uid_ = next_uid.fetch_add(1);
  const size_t n = tokenizer.vocab_size();
  v->vocab_size_ = n;
  v->bytes_.resize(n);
  v->text_.assign(n, 0);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    if (tokenizer.IsAdded(id)) continue;
    const std::string& b = tokenizer.TokenBytes(id);
    if (b.empty() || b.size() > 0xFFFF) continue;
    v->bytes_[i] = b;
    v->text_[i] = 1;
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return v->bytes_[a] < v->bytes_[b]; });
  // Preorder construction from the sorted strings: `path` holds the open nodes.
  std::vector<uint32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : ids) {
    const std::string& s = v->bytes_[id];
    if (prev != nullptr && *prev == s) {
      v->duplicates_.emplace_back(static_cast<uint32_t>(v->token_[path.back()]), id);
      continue;
    }
    size_t common = 0;
    if (prev != nullptr) {
      while (common < prev->size() && common < s.size() && (*prev)[common] == s[common]) ++common;
    }
    while (path.size() > common) {
      v->skip_[path.back()] = static_cast<uint32_t>(v->byte_.size());
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      path.push_back(static_cast<uint32_t>(v->byte_.size()));
      v->byte_.push_back(static_cast<uint8_t>(s[k]));
      v->depth_.push_back(static_cast<uint16_t>(k + 1));
      v->skip_.push_back(0);
      v->token_.push_back(-1);
    }
    v->token_[path.back()] = id;
    v->max_depth_ = std::max(v->max_depth_, s.size());
    prev = &s;
  }
  while (!path.empty()) {
    v->skip_[path.back()] = static_cast<uint32_t>(v->byte_.size());
    path.pop_back();
  }
  // The ids in duplicates_ were recorded against the node's token; keep (primary id, dup id).
  return v;
}

const std::string& VocabIndex::token_bytes(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && static_cast<size_t>(id) < bytes_.size() ? bytes_[id] : kEmpty;
}

bool VocabIndex::is_text_token(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < text_.size() && text_[id] != 0;
}

}  // namespace m3::constrain
