// The dense part of the model on an accelerator (--gpu dense, offload/dense_offload.h): what it
// needs there, checked before anything is uploaded, then every weight the passes read on it.
#include "model/dense_part.h"
#include "model/model.h"

namespace m3 {

StatusOr<std::unique_ptr<DenseOffload>> Model::OffloadDensePart(std::unique_ptr<Device> device,
                                                                uint64_t context) const {
  const ModelConfig& c = config_;
  const ModelWeights& w = weights_;
  // What the device will hold, in its layouts, before any of it is uploaded.
  uint64_t need = 0;
  ForEachDenseMatrix(w, /*shared_experts=*/true, /*lm_head=*/true, [&](const char* group, const simd::WeightRef& m) {
    if (std::string(group) != "MTP projection") need += DeviceLayoutFor(m).bytes();
  });
  GpuFootprint footprint = EstimateGpuFootprint(c, MeasureDensePart(c, w), CacheOptions{}, context);
  footprint.weight_bytes = need;
  M3_RETURN_IF_ERROR(CheckGpuFits(footprint, device->Describe(), device->FreeBytes()));

  auto o = std::make_unique<DenseOffload>(std::move(device), pass_shape());
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string at = Str("layer ", l, " ");
    M3_RETURN_IF_ERROR(o->Upload(at + "input norm", L.input_norm));
    M3_RETURN_IF_ERROR(o->Upload(at + "post-attention norm", L.post_norm));
    M3_RETURN_IF_ERROR(o->Upload(at + "q_proj", L.attn.q));
    M3_RETURN_IF_ERROR(o->Upload(at + "k_proj", L.attn.k));
    M3_RETURN_IF_ERROR(o->Upload(at + "v_proj", L.attn.v));
    M3_RETURN_IF_ERROR(o->Upload(at + "o_proj", L.attn.o));
    M3_RETURN_IF_ERROR(o->Upload(at + "q norm", L.attn.q_norm));
    M3_RETURN_IF_ERROR(o->Upload(at + "k norm", L.attn.k_norm));
    if (L.attn.sparse) {
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer q", L.attn.index_q));
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer k", L.attn.index_k));
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer q norm", L.attn.index_q_norm));
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer k norm", L.attn.index_k_norm));
    }
    const MlpWeights* mlp = L.is_moe ? (L.moe.has_shared ? &L.moe.shared : nullptr) : &L.mlp;
    if (L.is_moe) M3_RETURN_IF_ERROR(o->Upload(at + "router", L.moe.router));
    if (mlp) {
      M3_RETURN_IF_ERROR(o->Upload(at + "gate", mlp->gate));
      M3_RETURN_IF_ERROR(o->Upload(at + "up", mlp->up));
      M3_RETURN_IF_ERROR(o->Upload(at + "down", mlp->down));
    }
  }
  M3_RETURN_IF_ERROR(o->Upload("final norm", w.final_norm));
  M3_RETURN_IF_ERROR(o->Upload("lm_head", w.lm_head));
  M3_RETURN_IF_ERROR(o->FinishUploads());
  return o;
}

}  // namespace m3
