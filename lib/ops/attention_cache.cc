#include "ops/attention_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "simd/attention_kernels.h"
#include "simd/weight_format.h"

namespace m3 {

// One allocation that pages are carved from; freed once no page of it is held.
struct PageList::Arena {
  explicit Arena(uint8_t* p) : base(p) {}
  ~Arena() { std::free(base); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  uint8_t* base;
};

PageList::Page::Page(std::shared_ptr<Arena> a, uint8_t* d, size_t b, std::shared_ptr<PageAccount> acc)
    : arena(std::move(a)), data(d), bytes(b), account(std::move(acc)) {
  if (account) account->bytes += bytes;
}

PageList::Page::~Page() {
  if (account) account->bytes -= bytes;
}

PageRef PageList::NewPage() {
  if (!free_.empty()) {
    PageRef p = std::move(free_.back());
    free_.pop_back();
    return p;
  }
  constexpr size_t kHuge = size_t{2} << 20;
  if (spare_ == 0) {
    const size_t per_huge = std::max<size_t>(1, kHuge / page_bytes_);
    const size_t count = std::clamp<size_t>(data_.size(), 1, per_huge);
    size_t bytes = count * page_bytes_;
    const bool huge = bytes >= kHuge;
    if (huge) bytes = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(huge ? kHuge : 64, bytes);
    if (!p) throw std::bad_alloc();
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);  // best effort
    try {
      last_ = std::make_shared<Arena>(static_cast<uint8_t*>(p));
    } catch (...) {
      std::free(p);
      throw;
    }
    spare_ = count;
    next_ = last_->base;
  }
  PageRef page = std::make_shared<Page>(last_, next_, page_bytes_, account_);
  next_ += page_bytes_;
  --spare_;
  return page;
}

void PageList::EnsurePages(size_t n) {
  if (n > data_.size()) {
    data_.reserve(n);
    refs_.reserve(n);
  }
  while (data_.size() < n) {
    PageRef p = NewPage();
    data_.push_back(p->data);
    refs_.push_back(std::move(p));
  }
}

void PageList::Release() {
  data_.clear();
  refs_.clear();
  free_.clear();
  last_.reset();
  next_ = nullptr;
  spare_ = 0;
}

void PageList::Drop(PageRef page) {
  // Kept only where room was reserved: never throws (a page not kept is freed).
  if (page.use_count() == 1 && free_.size() < free_.capacity()) free_.push_back(std::move(page));
}

void PageList::ReserveSpare(size_t n) {
  try {
    if (free_.size() + n > free_.capacity()) free_.reserve(std::max(free_.size() + n, 2 * free_.capacity()));
  } catch (const std::bad_alloc&) {  // the pages are freed instead of kept
  }
}

void PageList::Adopt(size_t i, PageRef page) {
  if (i == data_.size()) {
    refs_.reserve(i + 1);
    data_.push_back(page->data);
    refs_.push_back(std::move(page));
    return;
  }
  ReserveSpare(1);
  PageRef old = std::move(refs_[i]);
  data_[i] = page->data;
  refs_[i] = std::move(page);
  Drop(std::move(old));
}

void PageList::DropSharedFrom(size_t i) {
  bool any = false;
  for (size_t j = i; j < refs_.size() && !any; ++j) any = shared(j);
  if (!any) return;
  ReserveSpare(refs_.size() - i);
  while (refs_.size() > i) {
    PageRef p = std::move(refs_.back());
    refs_.pop_back();
    data_.pop_back();
    Drop(std::move(p));
  }
}

void PageList::MakeExclusive(size_t i) {
  if (!shared(i)) return;
  PageRef fresh = NewPage();
  std::memcpy(fresh->data, data_[i], page_bytes_);
  data_[i] = fresh->data;
  refs_[i] = std::move(fresh);  // the other holders keep the old page
}

size_t KvPages::BytesPerRow(size_t heads, size_t dim, CacheType type) {
  return heads * (dim * simd::CacheTypeBytes(type) + (type == CacheType::kInt8 ? sizeof(float) : 0));
}

namespace {
// Room for one vector's int8 codes before they are scattered into a transposed page: on the stack
// for the dims models use (M3: 128), on the heap beyond.
class CodeBuffer {
 public:
  explicit CodeBuffer(size_t n) : data_(n <= sizeof(stack_) ? stack_ : (heap_.resize(n), heap_.data())) {}
  int8_t* data() { return data_; }
  int8_t operator[](size_t i) const { return data_[i]; }

 private:
  int8_t stack_[512];
  std::vector<int8_t> heap_;
  int8_t* data_;
};
}  // namespace

KvPages::KvPages(size_t heads, size_t dim, size_t page_rows, CacheType type, KvLayout layout)
    : RowPages(page_rows, page_rows * BytesPerRow(heads, dim, type)), heads_(heads), dim_(dim), type_(type),
      layout_(layout) {}

void KvPages::Write(size_t row, const float* x) {
  uint8_t* page = pages_.page(row / page_rows_);
  const size_t r = row % page_rows_, bytes = simd::CacheTypeBytes(type_);
  CodeBuffer codes(type_ == CacheType::kInt8 && layout_ != KvLayout::kRows ? dim_ : 0);
  for (size_t h = 0; h < heads_; ++h) {
    const float* src = x + h * dim_;
    float* scales = reinterpret_cast<float*>(page + heads_ * page_rows_ * dim_);  // int8 only
    if (layout_ == KvLayout::kRows) {
      void* dst = page + (h * page_rows_ + r) * dim_ * bytes;
      switch (type_) {
        case CacheType::kF32: std::memcpy(dst, src, dim_ * sizeof(float)); break;
        case CacheType::kBF16: simd::EncodeBf16(src, dim_, static_cast<uint16_t*>(dst)); break;
        case CacheType::kInt8: scales[h * page_rows_ + r] = simd::EncodeInt8(src, dim_, static_cast<int8_t*>(dst)); break;
      }
      continue;
    }
    const size_t at = h * dim_ * page_rows_ + r;  // value d at at + d * page_rows_
    switch (type_) {
      case CacheType::kF32:
        for (size_t d = 0; d < dim_; ++d) reinterpret_cast<float*>(page)[at + d * page_rows_] = src[d];
        break;
      case CacheType::kBF16:
        for (size_t d = 0; d < dim_; ++d) reinterpret_cast<uint16_t*>(page)[at + d * page_rows_] = simd::F32ToBf16(src[d]);
        break;
      case CacheType::kInt8:
        scales[h * page_rows_ + r] = simd::EncodeInt8(src, dim_, codes.data());
        for (size_t d = 0; d < dim_; ++d) reinterpret_cast<int8_t*>(page)[at + d * page_rows_] = codes[d];
        break;
    }
  }
}

const float* KvPages::Read(size_t a, size_t b, size_t head, float* scratch, size_t* ld) const {
  const uint8_t* page = pages_.page(a / page_rows_);
  const size_t r0 = a % page_rows_, n = b - a;
  const auto* scales = reinterpret_cast<const float*>(page + heads_ * page_rows_ * dim_) + head * page_rows_ + r0;
  if (layout_ == KvLayout::kRows) {
    if (ld) *ld = dim_;
    const size_t at = (head * page_rows_ + r0) * dim_;
    switch (type_) {
      case CacheType::kF32: return reinterpret_cast<const float*>(page) + at;
      case CacheType::kBF16: simd::DecodeBf16(reinterpret_cast<const uint16_t*>(page) + at, n * dim_, scratch); break;
      case CacheType::kInt8:
        for (size_t i = 0; i < n; ++i)
          simd::DecodeInt8(reinterpret_cast<const int8_t*>(page) + at + i * dim_, dim_, scales[i], scratch + i * dim_);
        break;
    }
    return scratch;
  }
  if (ld) *ld = page_rows_;
  const size_t at = head * dim_ * page_rows_ + r0;
  switch (type_) {
    case CacheType::kF32: return reinterpret_cast<const float*>(page) + at;
    case CacheType::kBF16:
      for (size_t d = 0; d < dim_; ++d)
        simd::DecodeBf16(reinterpret_cast<const uint16_t*>(page) + at + d * page_rows_, n, scratch + d * page_rows_);
      break;
    case CacheType::kInt8:
      for (size_t d = 0; d < dim_; ++d) {
        const int8_t* codes = reinterpret_cast<const int8_t*>(page) + at + d * page_rows_;
        float* o = scratch + d * page_rows_;
        for (size_t i = 0; i < n; ++i) o[i] = static_cast<float>(codes[i]) * scales[i];
      }
      break;
  }
  return scratch;
}

float KvPages::Value(size_t row, size_t head, size_t d) const {
  std::vector<float> scratch(page_rows_ * dim_);
  size_t ld = 0;
  const float* p = Read(row, row + 1, head, scratch.data(), &ld);
  return layout_ == KvLayout::kRows ? p[d] : p[d * ld];
}

size_t IndexKeyPages::BytesPerRow(size_t dim, CacheType type) {
  return dim * simd::CacheTypeBytes(type) + (type == CacheType::kInt8 ? sizeof(float) : 0);
}

IndexKeyPages::IndexKeyPages(size_t dim, size_t page_rows, CacheType type)
    : RowPages(page_rows, PaddedRows(page_rows) * BytesPerRow(dim, type)), dim_(dim), panel_(std::min(page_rows, kPanel)),
      type_(type) {}

void IndexKeyPages::Write(size_t row, const float* x) {
  uint8_t* page = pages_.page(row / page_rows_);
  const size_t r = row % page_rows_;
  switch (type_) {
    case CacheType::kF32:
      for (size_t d = 0; d < dim_; ++d) reinterpret_cast<float*>(page)[At(r, d)] = x[d];
      break;
    case CacheType::kBF16:
      for (size_t d = 0; d < dim_; ++d) reinterpret_cast<uint16_t*>(page)[At(r, d)] = simd::F32ToBf16(x[d]);
      break;
    case CacheType::kInt8: {
      CodeBuffer codes(dim_);
      reinterpret_cast<float*>(page + dim_ * PaddedRows(page_rows_))[r] = simd::EncodeInt8(x, dim_, codes.data());
      for (size_t d = 0; d < dim_; ++d) reinterpret_cast<int8_t*>(page)[At(r, d)] = codes[d];
      break;
    }
  }
}

simd::IndexKeyPage IndexKeyPages::Page(size_t page, size_t n_keys) const {
  const uint8_t* p = pages_.page(page);
  return {type_, p, type_ == CacheType::kInt8 ? reinterpret_cast<const float*>(p + dim_ * PaddedRows(page_rows_)) : nullptr,
          panel_, dim_, n_keys};
}

float IndexKeyPages::Value(size_t row, size_t d) const {
  const simd::IndexKeyPage page = Page(row / page_rows_, page_rows_);
  const float v = simd::ref::IndexKeyValue(page, d, row % page_rows_);
  return type_ == CacheType::kInt8 ? v * page.scales[row % page_rows_] : v;
}

}  // namespace m3
