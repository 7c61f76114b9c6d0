#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "base/aligned_buffer.h"
#include "ops/workspace.h"
#include "simd/attention_kernels.h"
#include "simd/kernels.h"

namespace m3 {

int SelectBlocksForQuery(const float* block_scores, int64_t pos, const SparseParams& p, int32_t* out,
                         std::vector<int32_t>* order_scratch) {
  const int64_t valid = pos / p.block_size + 1;
  const int64_t k_eff = std::min<int64_t>(p.topk_blocks, valid);
  if (valid <= p.topk_blocks) {
    for (int64_t b = 0; b < valid; ++b) out[b] = static_cast<int32_t>(b);
    return static_cast<int>(valid);
  }
  const int64_t init_end = std::min<int64_t>(p.init_blocks, valid);
  const int64_t local_begin = std::max<int64_t>(0, valid - p.local_blocks);
  auto prio = [&](int32_t b) { return b >= local_begin ? 1 : b < init_end ? 2 : 0; };  // local wins
  auto score = [&](int32_t b) { return std::isnan(block_scores[b]) ? -INFINITY : block_scores[b]; };
  // Forced blocks first (init before local), then by score descending, then by id ascending: a
  // strict order, so the k best are one nth_element away (O(blocks), no full sort per query).
  auto better = [&](int32_t a, int32_t b) {
    if (prio(a) != prio(b)) return prio(a) > prio(b);
    if (score(a) != score(b)) return score(a) > score(b);
    return a < b;
  };
  std::vector<int32_t> own;
  std::vector<int32_t>& order = order_scratch ? *order_scratch : own;
  order.resize(static_cast<size_t>(valid));
  std::iota(order.begin(), order.end(), 0);
  std::nth_element(order.begin(), order.begin() + (k_eff - 1), order.end(), better);
  std::copy_n(order.begin(), k_eff, out);
  std::sort(out, out + k_eff);
  return static_cast<int>(k_eff);
}

namespace {

constexpr size_t kQueryTile = 16;  // consecutive queries that share each key block they load

}  // namespace

void SelectBlocks(const OpContext& tc, const SparseParams& p, const float* iq, const IndexKeyPages& index_keys,
                  int64_t pos0, size_t n, BlockSelection* out) {
  const size_t heads = static_cast<size_t>(p.num_index_heads), dim = static_cast<size_t>(p.index_dim);
  const size_t B = static_cast<size_t>(p.block_size);
  if (index_keys.page_rows() != B) throw std::invalid_argument("SelectBlocks: index-key pages must hold one block");
  out->Reset(n, p.num_index_heads, p.topk_blocks);
  if (tc.workspace) tc.workspace->ReserveThreads(tc.threads);
  // Queries in parts of bounded size: block scores are [part][heads][blocks].
  constexpr size_t part = 256;
  const size_t last_pos = static_cast<size_t>(pos0) + n - 1, max_blocks = last_pos / B + 1;
  std::vector<float> block_scores;
  for (size_t t0 = 0; t0 < n; t0 += part) {
    const size_t tn = std::min(part, n - t0);
    block_scores.assign(tn * heads * max_blocks, -INFINITY);
    // Work items: (query tile, range of pages). A tile reads each page once for all its queries
    // and heads; one tile (decode) is split by pages so every thread scans part of the keys.
    const size_t tiles = (tn + kQueryTile - 1) / kQueryTile;
    const size_t tile_last_pos = static_cast<size_t>(pos0) + t0 + tn - 1;
    const size_t page_parts = tiles >= static_cast<size_t>(tc.threads) ? 1 : static_cast<size_t>(tc.threads);
    const size_t pages_per_part = (tile_last_pos / B + 1 + page_parts - 1) / page_parts;
    ParallelFor(tc, tiles * page_parts, 1, [&](size_t begin, size_t end, int) {
      for (size_t item = begin; item < end; ++item) {
        const size_t tile = item / page_parts, part_i = item % page_parts;
        const size_t a = tile * kQueryTile, e = std::min(tn, a + kQueryTile);  // queries [a, e) of the part
        const size_t end_pos = static_cast<size_t>(pos0) + t0 + e;
        const size_t b0 = part_i * pages_per_part, b1 = std::min((end_pos - 1) / B + 1, b0 + pages_per_part);
        std::vector<float> row_max(kQueryTile * heads);
        for (size_t b = b0; b < b1; ++b) {
          // Queries whose own position ends inside page b see only part of it; the others see
          // it all (one call for the whole run of them).
          size_t full_from = a;
          while (full_from < e && static_cast<size_t>(pos0) + t0 + full_from < (b + 1) * B - 1) ++full_from;
          for (size_t t = a; t < full_from; ++t) {
            const size_t pos = static_cast<size_t>(pos0) + t0 + t;
            if (pos < b * B) continue;  // page not visible yet
            if (pos / B + 1 <= static_cast<size_t>(p.topk_blocks)) continue;  // everything is selected
            simd::IndexScoreMax(iq + (t0 + t) * heads * dim, dim, heads, index_keys.Page(b, pos + 1 - b * B),
                                row_max.data());
            for (size_t h = 0; h < heads; ++h) block_scores[(t * heads + h) * max_blocks + b] = row_max[h];
          }
          if (full_from < e) {
            simd::IndexScoreMax(iq + (t0 + full_from) * heads * dim, dim, (e - full_from) * heads,
                                index_keys.Page(b, B), row_max.data());
            for (size_t t = full_from; t < e; ++t)
              for (size_t h = 0; h < heads; ++h)
                block_scores[(t * heads + h) * max_blocks + b] = row_max[(t - full_from) * heads + h];
          }
        }
      }
    });
    ParallelFor(tc, tn, 1, [&](size_t begin, size_t end, int th) {
      std::vector<int32_t>* order = tc.workspace ? &tc.workspace->thread(th).order : nullptr;
      for (size_t t = begin; t < end; ++t)
        for (size_t h = 0; h < heads; ++h) {
          const size_t q = t0 + t;
          out->counts[q * heads + h] = SelectBlocksForQuery(&block_scores[(t * heads + h) * max_blocks],
                                                            pos0 + static_cast<int64_t>(q), p,
                                                            &out->blocks[(q * heads + h) * p.topk_blocks], order);
        }
    });
  }
}

void Attention(const OpContext& tc, const AttentionParams& p, const float* q, const KvPages& k, const KvPages& v,
               int64_t pos0, size_t n, const BlockSelection* sel, float* out) {
  if (k.layout() != KvLayout::kTransposed || v.layout() != KvLayout::kRows)
    throw std::invalid_argument("Attention: K pages must be transposed and V pages rows (KvLayout)");
  if (sel && (k.page_rows() != static_cast<size_t>(p.block_size) || v.page_rows() != k.page_rows()))
    throw std::invalid_argument("Attention: with a block selection, K/V pages must hold one block");
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
  const size_t max_heads = groups.front().j1 - groups.front().j0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t B = sel ? static_cast<size_t>(p.block_size) : k.page_rows();  // keys per visited block
  const size_t P = pos0 >= 0 ? static_cast<size_t>(pos0) : 0;

  // Work items: query tiles, each split into head groups. Cost = keys read (causal prompts put
  // most of the work on late tokens; shares are by cost, not by token count).
  const size_t tiles = (n + kQueryTile - 1) / kQueryTile;
  auto keys_read = [&](size_t t) {
    const uint64_t visible = P + t + 1;
    return sel ? std::min<uint64_t>(visible, static_cast<uint64_t>(sel->Count(t, 0)) * B) : visible;
  };
  std::vector<size_t> units(tiles, groups.size());
  std::vector<uint64_t> cost(tiles, 0);
  for (size_t t = 0; t < n; ++t) cost[t / kQueryTile] += 64 + keys_read(t);

  ParallelRegion(tc, [&](int tid, int nt, auto) {
    AlignedBuffer<float> scores(kQueryTile * max_heads * B), k_tile(B * D), v_tile(B * D);
    AlignedBuffer<float> acc(kQueryTile * max_heads * D), q_rows(kQueryTile * max_heads * D);
    std::vector<float> run_max(kQueryTile * max_heads), run_sum(kQueryTile * max_heads);
    std::vector<size_t> row_keys(kQueryTile * max_heads);
    std::vector<int32_t> visit;
    std::vector<int> cursor(kQueryTile);
    std::vector<char> reads(kQueryTile);

    auto attend_tile = [&](size_t tile, const HeadGroup& grp) {
      const size_t t0 = tile * kQueryTile, tn = std::min(kQueryTile, n - t0), nh = grp.j1 - grp.j0;
      const size_t last_pos = P + t0 + tn - 1;
      const int idx = static_cast<int>(grp.idx);
      // Blocks to visit, ascending: every visible page (dense) or the union of the tile's selections.
      visit.clear();
      if (!sel) {
        for (size_t b = 0; b <= last_pos / B; ++b) visit.push_back(static_cast<int32_t>(b));
      } else {
        for (size_t t = t0; t < t0 + tn; ++t) visit.insert(visit.end(), sel->Blocks(t, idx), sel->Blocks(t, idx) + sel->Count(t, idx));
        std::sort(visit.begin(), visit.end());
        visit.erase(std::unique(visit.begin(), visit.end()), visit.end());
      }
      // The tile's query rows of this head group, [query][head][D]: the queries that read a block
      // attend to it in one AttendBlock call (its keys stay in L1 while all their heads pass over them).
      for (size_t i = 0; i < tn; ++i)
        std::copy_n(q + (t0 + i) * H * D + grp.j0 * D, nh * D, q_rows.data() + i * nh * D);
      std::fill_n(acc.data(), tn * nh * D, 0.0f);
      std::fill_n(run_max.begin(), tn * nh, -INFINITY);
      std::fill_n(run_sum.begin(), tn * nh, 0.0f);
      std::fill_n(cursor.begin(), tn, 0);
      for (const int32_t b : visit) {
        const size_t a = static_cast<size_t>(b) * B, e = std::min(a + B, last_pos + 1);
        bool any = false;
        for (size_t i = 0; i < tn; ++i) {
          const size_t t = t0 + i;
          reads[i] = P + t >= a;
          if (sel && reads[i]) {  // the query's own sorted list, walked along with `visit`
            const int32_t* mine = sel->Blocks(t, idx);
            reads[i] = cursor[i] < sel->Count(t, idx) && mine[cursor[i]] == b;
            if (reads[i]) ++cursor[i];
          }
          any = any || reads[i];
        }
        if (!any) continue;
        size_t ldk = 0;
        const float* kt = k.Read(a, e, grp.kv, k_tile.data(), &ldk);
        const float* vt = v.Read(a, e, grp.kv, v_tile.data());
        // The keys each row sees: 0 for queries that skip block b, fewer in the block holding their
        // own position.
        for (size_t i = 0; i < tn; ++i)
          std::fill_n(row_keys.begin() + i * nh, nh, reads[i] ? std::min(e, P + t0 + i + 1) - a : 0);
        simd::AttendBlock(q_rows.data(), D, tn * nh, kt, ldk, row_keys.data(), vt, D, D, scale, scores.data(), B,
                          run_max.data(), run_sum.data(), acc.data(), D);
      }
      for (size_t i = 0; i < tn; ++i)
        for (size_t h = 0; h < nh; ++h) {
          float* dst = out + (t0 + i) * H * D + (grp.j0 + h) * D;
          const float* o = acc.data() + (i * nh + h) * D;
          const float l = run_sum[i * nh + h];
          if (l != 0.0f) {  // NaN included: a NaN score must not turn into zeros
            for (size_t c = 0; c < D; ++c) dst[c] = o[c] / l;
          } else {
            std::fill_n(dst, D, 0.0f);  // no visible key (a sparse setting without the local block)
          }
        }
    };
    ForEachShare(units, cost, tid, nt, [&](size_t tile, size_t g0, size_t g1) {
      for (size_t g = g0; g < g1; ++g) attend_tile(tile, groups[g]);
    });
  });
}

}  // namespace m3
