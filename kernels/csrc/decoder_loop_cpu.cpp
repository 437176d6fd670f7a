// A decoder step's whole layer loop in one call, for the plain pre-norm layer
// (kernels/decoder_loop.py says which models take it; worker_svc/models/decoder.py's
// `_layer` is the loop it replaces). The Python loop spent ~14 dispatched ops and ~20
// Python frames a layer around the kernels; here the same ops run in the same order
// with the same arguments, so the hidden states are bit-identical to the Python
// loop's, and only the frames go.
//
// The pagedserve_cpu kernels are called boxed, through the dispatcher by their
// schema (as torch.ops calls them from Python): this file depends on their schemas,
// not on their C++ signatures, so a kernel rewritten behind the same schema needs no
// change here.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using Stack = std::vector<c10::IValue>;

c10::OperatorHandle find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(("pagedserve_cpu::" + name).c_str(), "");
}

// One multiply: linear over a packed weight (with its fused activation), or
// quant_linear[_int8] over GGUF blocks.
struct Part {
  c10::OperatorHandle op;
  bool quantized;
  Tensor weight;
  std::string qtype;
  int64_t out_features;
  int64_t in_features;
  std::string activation;

  Tensor operator()(const Tensor& x) const {
    Stack stack;
    if (quantized) {
      stack = {x, weight, qtype, out_features};
    } else {
      stack = {x, weight, out_features, in_features, activation};
    }
    op.callBoxed(stack);
    return stack[0].toTensor();
  }
};

// One projection as models/linear.py's objects run it: its parts side by side
// (Concat: blocks of different formats), then the bias, then the gated activation
// where the kernel did not fuse it (Gated: gated_act, the op models/linear.py calls).
struct Projection {
  std::vector<Part> parts;
  std::optional<Tensor> bias;
  std::string gated;
  c10::OperatorHandle gated_act;

  Tensor operator()(const Tensor& x) const {
    Tensor y;
    if (parts.size() == 1) {
      y = parts[0](x);
    } else {
      std::vector<Tensor> outs;
      for (const Part& part : parts) {
        outs.push_back(part(x));
      }
      y = at::cat(outs, -1);
    }
    if (bias.has_value()) {
      y = at::add(y, *bias);
    }
    if (!gated.empty()) {
      Stack stack = {y, gated};
      gated_act.callBoxed(stack);
      y = stack[0].toTensor();
    }
    return y;
  }
};

struct Layer {
  Tensor attn_norm;  // fp32, as cpu_ops.add_rms_norm passes it
  Tensor mlp_norm;
  int64_t window;
};

class DecoderLoop : public torch::CustomClassHolder {
 public:
  DecoderLoop(int64_t q_heads, int64_t kv_heads, int64_t head_dim, double eps)
      : q_heads_(q_heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        add_rms_norm_(find_op("add_rms_norm")),
        rope_write_kv_(find_op("rope_write_kv")),
        attention_(find_op("paged_attention")),
        gated_act_(find_op("gated_act")) {}

  // op: "linear", "quant_linear" or "quant_linear_int8": one part of the projection
  // that add_projection closes.
  void add_part(const std::string& op, const Tensor& weight, const std::string& qtype, int64_t out_features,
                int64_t in_features, const std::string& activation) {
    TORCH_CHECK(op == "linear" || op == "quant_linear" || op == "quant_linear_int8", "unknown projection op ", op);
    parts_.push_back({find_op(op), op != "linear", weight, qtype, out_features, in_features, activation});
  }

  // The parts added since the last projection, as one; a layer's four projections
  // come in the order qkv, o, gate_up, down.
  void add_projection(const std::optional<Tensor>& bias, const std::string& gated) {
    TORCH_CHECK(!parts_.empty(), "a projection needs a part");
    TORCH_CHECK(gated.empty() || gated == "silu" || gated == "gelu_tanh", "unknown gated activation ", gated);
    projections_.push_back({std::move(parts_), bias, gated, gated_act_});
    parts_.clear();
  }

  void add_layer(const Tensor& attn_norm, const Tensor& mlp_norm, int64_t window) {
    TORCH_CHECK(projections_.size() == 4 * (layers_.size() + 1), "add a layer's four projections before the layer");
    layers_.push_back({attn_norm, mlp_norm, window});
  }

  // delta [T, hidden] (the embeddings: the first layer's stream) -> (the last layer's
  // MLP output, the stream before it), as DecoderModel._layer's loop returns them.
  // k_cache, v_cache: the whole pool [layers, ...]; cu_query_lens None: one row per
  // sequence (decode).
  std::tuple<Tensor, Tensor> forward(Tensor delta, const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
                                     const Tensor& v_cache, const Tensor& slot_mapping, const Tensor& block_tables,
                                     const std::optional<Tensor>& cu_query_lens, const Tensor& context_lens,
                                     double scale, double softcap) {
    TORCH_CHECK(k_cache.size(0) == static_cast<int64_t>(layers_.size()), "the cache's layers != the loop's");
    select_layers(k_cache, v_cache);
    const int64_t tokens = delta.size(0);
    const std::vector<int64_t> heads = {q_heads_, kv_heads_, kv_heads_};
    c10::IValue residual;  // None: the first layer's stream is the embedding itself
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const Projection* proj = &projections_[4 * i];
      auto [x, stream] = add_norm(delta, residual, layer.attn_norm);
      residual = stream;
      Tensor qkv = proj[0](x);
      auto qkv_heads = qkv.view({tokens, q_heads_ + 2 * kv_heads_, head_dim_}).split_with_sizes(heads, 1);
      Stack rope = {qkv_heads[0], qkv_heads[1], qkv_heads[2], cos, sin, k_layers_[i], v_layers_[i], slot_mapping};
      rope_write_kv_.callBoxed(rope);
      Tensor q = rope[0].toTensor();
      if (q.stride(-1) != 1) {
        q = q.contiguous();
      }
      Stack attend = {q,         k_layers_[i], v_layers_[i], block_tables, cu_query_lens,
                      context_lens, scale,      layer.window, softcap,      c10::IValue(),
                      c10::IValue(), c10::IValue(), c10::IValue()};
      attention_.callBoxed(attend);
      Tensor attn = proj[1](attend[0].toTensor().reshape({tokens, q_heads_ * head_dim_}));
      auto [h, stream2] = add_norm(attn, residual, layer.mlp_norm);
      residual = stream2;
      delta = proj[3](proj[2](h));
    }
    return {delta, residual.toTensor()};
  }

 private:
  std::pair<Tensor, Tensor> add_norm(const Tensor& delta, const c10::IValue& residual, const Tensor& weight) const {
    Stack stack = {delta, residual, weight, eps_};
    add_rms_norm_.callBoxed(stack);
    return {stack[0].toTensor(), stack[1].toTensor()};
  }

  // Each layer's views of the pool, made once per pool (as kv_cache.py's are).
  void select_layers(const Tensor& k_cache, const Tensor& v_cache) {
    if (k_pool_.defined() && k_pool_.is_same(k_cache) && v_pool_.is_same(v_cache)) {
      return;
    }
    k_pool_ = k_cache;
    v_pool_ = v_cache;
    k_layers_.clear();
    v_layers_.clear();
    for (int64_t i = 0; i < k_cache.size(0); ++i) {
      k_layers_.push_back(k_cache.select(0, i));
      v_layers_.push_back(v_cache.select(0, i));
    }
  }

  int64_t q_heads_, kv_heads_, head_dim_;
  double eps_;
  c10::OperatorHandle add_rms_norm_, rope_write_kv_, attention_, gated_act_;
  std::vector<Part> parts_;
  std::vector<Projection> projections_;
  std::vector<Layer> layers_;
  Tensor k_pool_, v_pool_;
  std::vector<Tensor> k_layers_, v_layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.class_<DecoderLoop>("DecoderLoop")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_part", &DecoderLoop::add_part)
      .def("add_projection", &DecoderLoop::add_projection)
      .def("add_layer", &DecoderLoop::add_layer)
      .def("forward", &DecoderLoop::forward);
}
