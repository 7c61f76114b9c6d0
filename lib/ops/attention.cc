#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <utility>

#include "base/aligned_buffer.h"
#include "kernels.h"

namespace m3 {

void PagedRows::FreeDeleter::operator()(float* p) const { std::free(p); }

void PagedRows::EnsureRows(size_t n) {
  const size_t page_bytes = (page_rows_ * width_ * sizeof(float) + 63) / 64 * 64;
  while (capacity_rows() < n) {
    void* p = std::aligned_alloc(64, page_bytes);
    if (!p) throw std::bad_alloc();
    pages_.emplace_back(static_cast<float*>(p));
  }
}

int SelectBlocksForQuery(const float* block_scores, int64_t pos, const SparseParams& p, int32_t* out) {
  const int64_t valid = pos / p.block_size + 1;
  const int64_t k_eff = std::min<int64_t>(p.topk_blocks, valid);
  if (valid <= p.topk_blocks) {
    for (int64_t b = 0; b < valid; ++b) out[b] = static_cast<int32_t>(b);
    return static_cast<int>(valid);
  }
  auto score = [&](int64_t b) { return std::isnan(block_scores[b]) ? -INFINITY : block_scores[b]; };
  std::vector<int> prio(valid, 0);
  for (int64_t b = 0; b < std::min<int64_t>(p.init_blocks, valid); ++b) prio[b] = 2;
  for (int64_t b = std::max<int64_t>(0, valid - p.local_blocks); b < valid; ++b) prio[b] = 1;  // local wins
  std::vector<int32_t> order(valid);
  std::iota(order.begin(), order.end(), 0);
  // Forced blocks first (init before local), then by score descending, then by id ascending.
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (prio[a] != prio[b]) return prio[a] > prio[b];
    return score(a) > score(b);
  });
  std::copy_n(order.begin(), k_eff, out);
  std::sort(out, out + k_eff);
  return static_cast<int>(k_eff);
}

void SelectBlocks(const ThreadConfig& tc, const SparseParams& p, const float* iq, const PagedRows& index_keys,
                  int64_t pos0, size_t n, BlockSelection* out) {
  const int heads = p.num_index_heads;
  const size_t dim = static_cast<size_t>(p.index_dim);
  const size_t B = static_cast<size_t>(p.block_size);
  out->Reset(n, heads, p.topk_blocks);
  ParallelFor(tc, n, 1, [&](size_t begin, size_t end, int) {
    std::vector<float> block_scores, key_scores(heads * B);
    for (size_t t = begin; t < end; ++t) {
      const int64_t pos = pos0 + static_cast<int64_t>(t);
      const size_t valid = static_cast<size_t>(pos) / B + 1;
      const float* q = iq + t * heads * dim;
      block_scores.assign(heads * valid, 0.0f);
      if (valid > static_cast<size_t>(p.topk_blocks)) {
        // Per-key scores of a whole block for all index heads at once, then a max per head.
        for (size_t b = 0; b < valid; ++b) {
          const size_t a = b * B, e = std::min(a + B, static_cast<size_t>(pos) + 1);
          simd::MatMulF32(index_keys.Row(a), dim, e - a, q, dim, heads, dim, key_scores.data(), B);
          for (int h = 0; h < heads; ++h) block_scores[h * valid + b] = simd::MaxValue(&key_scores[h * B], e - a);
        }
      }
      for (int h = 0; h < heads; ++h)
        out->counts[t * heads + h] =
            SelectBlocksForQuery(&block_scores[h * valid], pos, p, &out->blocks[(t * heads + h) * p.topk_blocks]);
    }
  });
}

void Attention(const ThreadConfig& tc, const AttentionParams& p, const float* q, const PagedRows& k,
               const PagedRows& v, int64_t pos0, size_t n, const BlockSelection* sel, float* out) {
  const size_t H = p.num_heads, D = p.head_dim;
  const size_t per_kv = H / p.num_kv_heads;
  const size_t per_idx = sel ? H / p.num_index_heads : H;
  // Consecutive query heads that share a KV head and an index head share every key they read.
  struct HeadGroup {
    size_t j0, j1, kv, idx;
  };
  std::vector<HeadGroup> groups;
  for (size_t j = 0; j < H; ++j) {
    if (groups.empty() || groups.back().kv != j / per_kv || groups.back().idx != j / per_idx)
      groups.push_back({j, j, j / per_kv, j / per_idx});
    groups.back().j1 = j + 1;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t page = k.page_rows();

  // Work per token grows with the keys it reads (its position, causally, or its selected blocks):
  // shares of equal cost, not of equal token counts, or the thread with the late tokens of a
  // prompt does ~3/4 of the work (2 threads, causal).
  std::vector<size_t> units(n, groups.size());
  std::vector<uint64_t> cost(n);
  for (size_t t = 0; t < n; ++t) {
    const uint64_t visible = static_cast<uint64_t>(pos0) + t + 1;
    cost[t] = 64 + (sel ? std::min<uint64_t>(visible, static_cast<uint64_t>(sel->Count(t, 0)) *
                                                          static_cast<uint64_t>(p.block_size))
                        : visible);
  }
  ParallelRegion(tc, [&](int tid, int nt, auto) {
    AlignedBuffer<float> scores;
    std::vector<std::pair<size_t, size_t>> ranges;
    auto add_range = [&](size_t a, size_t b) {  // split at page boundaries: rows stay contiguous
      while (a < b) {
        const size_t e = std::min(b, (a / page + 1) * page);
        ranges.emplace_back(a, e);
        a = e;
      }
    };
    auto attend = [&](size_t t, const HeadGroup& grp) {
      const size_t pos = static_cast<size_t>(pos0) + t;
      ranges.clear();
      if (!sel) {
        add_range(0, pos + 1);
      } else {
        const int32_t* blocks = sel->Blocks(t, static_cast<int>(grp.idx));
        for (int i = 0; i < sel->Count(t, static_cast<int>(grp.idx)); ++i) {
          const size_t a = static_cast<size_t>(blocks[i]) * p.block_size;
          add_range(a, std::min(a + p.block_size, pos + 1));
        }
      }
      size_t nk = 0;
      for (auto [a, b] : ranges) nk += b - a;
      const size_t nh = grp.j1 - grp.j0;
      float* o = out + t * H * D + grp.j0 * D;
      std::fill_n(o, nh * D, 0.0f);
      if (nk == 0) return;
      scores.EnsureSize(nh * nk);
      const float* qh = q + t * H * D + grp.j0 * D;
      size_t off = 0;
      for (auto [a, b] : ranges) {
        simd::MatMulF32(k.Row(a) + grp.kv * D, k.width(), b - a, qh, D, nh, D, scores.data() + off, nk);
        off += b - a;
      }
      for (size_t h = 0; h < nh; ++h) {
        float* s = scores.data() + h * nk;
        simd::Scale(s, scale, nk);
        const float mx = simd::MaxValue(s, nk);
        simd::Scale(s, 1.0f / simd::ExpShiftSum(s, nk, mx), nk);  // probabilities
      }
      off = 0;
      for (auto [a, b] : ranges) {
        simd::MatMulAccumulate(scores.data() + off, nk, nh, v.Row(a) + grp.kv * D, v.width(), b - a, D, o, D);
        off += b - a;
      }
    };
    ForEachShare(units, cost, tid, nt, [&](size_t t, size_t g0, size_t g1) {
      for (size_t g = g0; g < g1; ++g) attend(t, groups[g]);
    });
  });
}

}  // namespace m3
