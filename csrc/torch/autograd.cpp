// Autograd of kl_penalty_fwd, kl_masked_mean_fwd and policy_loss_fwd, in C++ (the Autograd key, so
// every backend). These ops run in well under a millisecond at RL batch sizes, where autograd written
// in Python (torch.library.register_autograd: a Python autograd.Function around the op, a Python
// backward) cost about as much as the kernels: ~0.1 ms forward and ~0.2 ms backward per call on a
// 2-core EPYC. Here the forward redispatches below autograd to the backend kernel and the backward is
// one call.
//
// The backward (megalign/ops/kl_penalty.py, "with_dlogp"): when the forward also wrote d out / d logp
// (CPU kernels, fp32 / fp64), the first backward scales that buffer in place by the upstream gradient
// and hands it out as the gradient; the buffer is given out once, so a second backward through a
// retained graph recomputes with the *_bwd kernel, as do CUDA and bf16 / fp16. With one upstream
// value (a masked mean, or a sum of the per-token KL) the scale and the negation that is
// d/d ref_logp are one pass over the buffer (take_dlogp_grads). While tracing
// (torch.compile, opcheck: fake / functional tensors) the scale is out of place, since a traced
// backward may not mutate a forward output.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kDlogp = "dlogp";

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Marks the outputs besides the differentiable one (`others`, then dlogp: one call, as each call
// replaces the set) and keeps the forward's dlogp output (if written) for the first backward. The
// non-differentiable outputs get no zero-filled gradient (materialize_grads off: a [B, T] fill for
// dlogp per backward otherwise); each backward returns no gradient when its one input gradient is
// undefined.
void keep_dlogp(AutogradContext* ctx, const Tensor& dlogp, bool with_dlogp, variable_list others = {}) {
  others.push_back(dlogp);
  ctx->mark_non_differentiable(others);
  ctx->set_materialize_grads(false);
  if (with_dlogp) ctx->saved_data[kDlogp] = dlogp;
}

// The value of a CPU fp32 / fp64 gradient that holds one value for every element (0-d, one
// element, or expanded with every stride 0: a masked mean's or a sum's upstream gradient), or none.
std::optional<double> host_scalar(const Tensor& g) {
  if (!g.defined() || at::isTensorSubclassLike(g) || !g.device().is_cpu() || g.numel() == 0) return std::nullopt;
  if (g.numel() > 1) {
    for (const int64_t stride : g.strides()) {
      if (stride != 0) return std::nullopt;
    }
  }
  if (g.scalar_type() == at::kFloat) return *g.const_data_ptr<float>();
  if (g.scalar_type() == at::kDouble) return *g.const_data_ptr<double>();
  return std::nullopt;
}

// d[i] *= s and, with `negated`, negated[i] = -d[i], in one pass over the buffer.
template <typename T>
void scale_and_negate(T* d, T* negated, T s, int64_t n) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    if (negated) {
      for (int64_t i = begin; i < end; ++i) {
        d[i] *= s;
        negated[i] = -d[i];
      }
    } else {
      for (int64_t i = begin; i < end; ++i) d[i] *= s;
    }
  });
}

// The first backward's gradients from the kept dlogp: d/d logp = dlogp * upstream (in place on a
// real tensor) and, with `negated`, d/d ref_logp = its negation (else undefined). `scale` is the
// upstream gradient (broadcast against dlogp), or its value when it is one scalar (`host`); with a
// scalar and a dense CPU buffer both gradients come out of one pass with no tensor op between
// (the backward of these sub-millisecond ops otherwise spends as long in a mul_, a neg and their
// dispatch). Both undefined when no dlogp is left (no with_dlogp, or a second backward): the
// caller recomputes.
std::pair<Tensor, Tensor> take_dlogp_grads(AutogradContext* ctx, const std::function<Tensor()>& scale,
                                           std::optional<double> host, bool negated) {
  auto it = ctx->saved_data.find(kDlogp);
  if (it == ctx->saved_data.end()) return {};
  Tensor dlogp = it->second.toTensor();
  ctx->saved_data.erase(it);
  if (host && !at::isTensorSubclassLike(dlogp) && dlogp.device().is_cpu() && dlogp.is_contiguous()) {
    Tensor neg = negated ? at::empty_like(dlogp) : Tensor();
    AT_DISPATCH_FLOATING_TYPES(dlogp.scalar_type(), "megalign_dlogp_grads", [&] {
      scale_and_negate<scalar_t>(dlogp.data_ptr<scalar_t>(), negated ? neg.data_ptr<scalar_t>() : nullptr,
                                 static_cast<scalar_t>(*host), dlogp.numel());
    });
    return {dlogp, neg};
  }
  const Tensor s = scale();
  Tensor grad = at::isTensorSubclassLike(dlogp) || at::isTensorSubclassLike(s) ? dlogp * s : dlogp.mul_(s);
  return {grad, negated ? -grad : Tensor()};
}

// The gradient list of a KL op from d/d logp (and d/d ref_logp, computed here if not given): every
// KL estimator depends on logp - ref_logp only.
variable_list pair_grads(AutogradContext* ctx, const Tensor& grad_logp, Tensor grad_ref, size_t n_inputs) {
  variable_list grads(n_inputs);
  if (ctx->needs_input_grad(0)) grads[0] = grad_logp;
  if (ctx->needs_input_grad(1)) grads[1] = grad_ref.defined() ? grad_ref : -grad_logp;
  return grads;
}

// ---- kl_penalty ---------------------------------------------------------------------------------

using KlFwd = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::string_view, bool);
using KlBwd = Tensor(const Tensor&, const Tensor&, const Tensor&, c10::string_view);

struct KlPenalty : torch::autograd::Function<KlPenalty> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logp, const Tensor& ref_logp,
                               c10::string_view kind, bool with_dlogp) {
    static const auto fwd = op_handle<KlFwd>("megalign::kl_penalty_fwd");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, dlogp] = fwd.call(logp, ref_logp, kind, with_dlogp);
    ctx->save_for_backward({logp, ref_logp});
    ctx->saved_data["kind"] = std::string(kind);
    keep_dlogp(ctx, dlogp, with_dlogp);
    return {out, dlogp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op_handle<KlBwd>("megalign::kl_penalty_bwd");
    if (!grads[0].defined()) return variable_list(4);
    auto [grad_logp, grad_ref] =
        take_dlogp_grads(ctx, [&] { return grads[0]; }, host_scalar(grads[0]), ctx->needs_input_grad(1));
    if (!grad_logp.defined()) {
      const auto saved = ctx->get_saved_variables();
      grad_logp = bwd.call(grads[0], saved[0], saved[1], ctx->saved_data["kind"].toStringRef());
    }
    return pair_grads(ctx, grad_logp, grad_ref, 4);
  }
};

std::tuple<Tensor, Tensor> kl_penalty_fwd_autograd(const Tensor& logp, const Tensor& ref_logp,
                                                   c10::string_view kind, bool with_dlogp) {
  auto out = KlPenalty::apply(logp, ref_logp, kind, with_dlogp);
  return {out[0], out[1]};
}

// ---- kl_masked_mean -----------------------------------------------------------------------------

using MaskedFwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view,
                                                     bool);
using MaskedBwd = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::string_view);

struct KlMaskedMean : torch::autograd::Function<KlMaskedMean> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logp, const Tensor& ref_logp, const Tensor& mask,
                               c10::string_view kind, bool with_dlogp) {
    static const auto fwd = op_handle<MaskedFwd>("megalign::kl_masked_mean_fwd");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [mean, count, dlogp] = fwd.call(logp, ref_logp, mask, kind, with_dlogp);
    ctx->save_for_backward({logp, ref_logp, mask, count});
    ctx->saved_data["kind"] = std::string(kind);
    keep_dlogp(ctx, dlogp, with_dlogp, {count});
    return {mean, count, dlogp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op_handle<MaskedBwd>("megalign::kl_masked_mean_bwd");
    if (!grads[0].defined()) return variable_list(5);
    const auto saved = ctx->get_saved_variables();
    const Tensor& count = saved[3];
    // The kernel backward's scale: grad_mean / count, in the gradient's dtype as a tensor division
    // would round it; the max / clamp only avoid 0 / 0 (no valid token).
    std::optional<double> host = host_scalar(grads[0]);
    if (host && !at::isTensorSubclassLike(count) && count.device().is_cpu()) {
      const auto n = std::max<int64_t>(*count.const_data_ptr<int64_t>(), 1);
      host = grads[0].scalar_type() == at::kFloat
                 ? static_cast<double>(static_cast<float>(*host) / static_cast<float>(n))
                 : *host / static_cast<double>(n);
    } else {
      host.reset();
    }
    auto [grad_logp, grad_ref] = take_dlogp_grads(
        ctx, [&] { return grads[0] / count.clamp_min(1); }, host, ctx->needs_input_grad(1));
    if (!grad_logp.defined()) {
      grad_logp = bwd.call(grads[0], count, saved[0], saved[1], saved[2], ctx->saved_data["kind"].toStringRef());
    }
    return pair_grads(ctx, grad_logp, grad_ref, 5);
  }
};

std::tuple<Tensor, Tensor, Tensor> kl_masked_mean_fwd_autograd(const Tensor& logp, const Tensor& ref_logp,
                                                               const Tensor& mask, c10::string_view kind,
                                                               bool with_dlogp) {
  auto out = KlMaskedMean::apply(logp, ref_logp, mask, kind, with_dlogp);
  return {out[0], out[1], out[2]};
}

// ---- policy_loss --------------------------------------------------------------------------------

using PolicyFwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                     double, double, std::optional<double>, double,
                                                     const std::optional<Tensor>&, bool, bool);
using PolicyBwd = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double,
                         std::optional<double>, double, const std::optional<Tensor>&);

struct PolicyLoss : torch::autograd::Function<PolicyLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logp, const Tensor& old_logp,
                               const Tensor& advantages, const Tensor& mask, double eps_low, double eps_high,
                               std::optional<double> dual_clip, double beta, const std::optional<Tensor>& ref_logp,
                               bool with_dlogp, bool sum_loss) {
    static const auto fwd = op_handle<PolicyFwd>("megalign::policy_loss_fwd");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [loss, stats, dlogp] = fwd.call(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                                         ref_logp, with_dlogp, sum_loss);
    ctx->save_for_backward({logp, old_logp, advantages, mask, ref_logp.value_or(Tensor())});
    ctx->saved_data["eps_low"] = eps_low;
    ctx->saved_data["eps_high"] = eps_high;
    ctx->saved_data["dual_clip"] = dual_clip;
    ctx->saved_data["beta"] = beta;
    keep_dlogp(ctx, dlogp, with_dlogp, {stats});
    return {loss, stats, dlogp};
  }

  // d loss / d logp only: old_logp, advantages and ref_logp are constants of the RL step. The
  // gradient expanded to logp's shape is itself for a per-token loss and, for a summed loss's 0-d
  // gradient, every token's upstream gradient.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op_handle<PolicyBwd>("megalign::policy_loss_bwd");
    if (!grads[0].defined()) return variable_list(11);
    Tensor grad_logp = take_dlogp_grads(ctx, [&] { return grads[0]; }, host_scalar(grads[0]), false).first;
    if (!grad_logp.defined()) {
      const auto saved = ctx->get_saved_variables();
      const auto& data = ctx->saved_data;
      const c10::IValue& dual_clip = data.at("dual_clip");
      grad_logp = bwd.call(grads[0].expand(saved[0].sizes()), saved[0], saved[1], saved[2], saved[3], data.at("eps_low").toDouble(),
                           data.at("eps_high").toDouble(),
                           dual_clip.isNone() ? std::nullopt : std::optional<double>(dual_clip.toDouble()),
                           data.at("beta").toDouble(),
                           saved[4].defined() ? std::optional<Tensor>(saved[4]) : std::nullopt);
    }
    variable_list out(11);
    out[0] = grad_logp;
    return out;
  }
};

std::tuple<Tensor, Tensor, Tensor> policy_loss_fwd_autograd(const Tensor& logp, const Tensor& old_logp,
                                                            const Tensor& advantages, const Tensor& mask,
                                                            double eps_low, double eps_high,
                                                            std::optional<double> dual_clip, double beta,
                                                            const std::optional<Tensor>& ref_logp, bool with_dlogp,
                                                            bool sum_loss) {
  auto out = PolicyLoss::apply(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp,
                               with_dlogp, sum_loss);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(megalign, Autograd, m) {
  m.impl("kl_penalty_fwd", &kl_penalty_fwd_autograd);
  m.impl("kl_masked_mean_fwd", &kl_masked_mean_fwd_autograd);
  m.impl("policy_loss_fwd", &policy_loss_fwd_autograd);
}
