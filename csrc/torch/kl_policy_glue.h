// Torch glue of kl_penalty and policy_loss shared by the CPU and CUDA registrations: argument
// checks (each error names the op and the argument), [..., T] -> [rows, T] views, output
// allocation. Each *_glue function takes the backend's launcher as a callable, so the CPU file and
// the CUDA file differ only in the launcher they pass (and the CUDA stream/guard).
#pragma once

#include <optional>
#include <string>

#include "checks.h"
#include "megalign/kl_penalty.h"
#include "megalign/policy_loss.h"

namespace megalign::torch_glue {

// Shape [..., T] as [rows, T]: a view whenever the strides allow (slices, stride-0 expansions),
// a copy otherwise. The returned tensor owns the memory the kernel reads.
inline at::Tensor as_rows(const at::Tensor& t) {
  const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return t.reshape({rows, cols});
}

inline StridedView strided(const at::Tensor& rows2d) {
  return {rows2d.data_ptr(), rows2d.stride(0), rows2d.stride(1)};
}

// Outputs are in fp32, or fp64 for fp64 inputs.
inline at::ScalarType acc_scalar_type(const at::Tensor& logp) {
  return logp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_like(const at::Tensor& logp, const at::Tensor& t, const char* op, const char* arg) {
  check_same_device(logp, t, op, "logp", arg);
  check_same_shape(logp, t, op, "logp", arg);
  check_dtype(t, logp.scalar_type(), op, arg);
}

// The incoming gradient of an output shaped like logp, in the output dtype.
inline void check_grad(const at::Tensor& logp, const at::Tensor& grad, const char* op) {
  check_same_device(logp, grad, op, "logp", "grad");
  check_same_shape(logp, grad, op, "logp", "grad");
  check_dtype(grad, acc_scalar_type(logp), op, "grad");
}

inline MaskDType to_mask_dtype(const at::Tensor& mask, const char* op) {
  switch (mask.scalar_type()) {
    case at::kBool:
    case at::kByte: return MaskDType::kBool;
    case at::kInt: return MaskDType::kInt32;
    case at::kLong: return MaskDType::kInt64;
    case at::kFloat: return MaskDType::kFloat32;
    case at::kDouble: return MaskDType::kFloat64;
    case at::kBFloat16: return MaskDType::kBFloat16;
    case at::kHalf: return MaskDType::kFloat16;
    default:
      TORCH_CHECK(false, "megalign::", op, ": mask must be bool, uint8, int32, int64 or a float dtype, got ",
                  mask.scalar_type());
  }
}

inline void check_mask(const at::Tensor& logp, const at::Tensor& mask, const char* op) {
  check_same_device(logp, mask, op, "logp", "mask");
  check_same_shape(logp, mask, op, "logp", "mask");
}

inline KlKind to_kl_kind(const std::string& kind, const char* op) {
  if (kind == "k1") return KlKind::kK1;
  if (kind == "abs") return KlKind::kAbs;
  if (kind == "k2") return KlKind::kK2;
  if (kind == "k3") return KlKind::kK3;
  if (kind == "low_var_kl") return KlKind::kLowVarKl;
  TORCH_CHECK(false, "megalign::", op, ": kind must be one of k1, abs, k2, k3, low_var_kl, got '", kind, "'");
}

// ---- kl_penalty -------------------------------------------------------------------------------

// The [rows, T] operands (kept alive for the launch) and the launcher arguments.
struct KlCall {
  at::Tensor logp;
  at::Tensor ref_logp;
  at::Tensor mask;
  KlArgs args{};
  KlMaskArg mask_arg{};
};

inline KlCall prepare_kl(const at::Tensor& logp, const at::Tensor& ref_logp, const std::string& kind,
                         const at::Tensor* mask, const char* op) {
  const DType dtype = to_dtype(logp, op, "logp");
  check_like(logp, ref_logp, op, "ref_logp");
  KlCall call;
  call.logp = as_rows(logp);
  call.ref_logp = as_rows(ref_logp);
  call.args = KlArgs{dtype, to_kl_kind(kind, op), call.logp.size(0), call.logp.size(1), strided(call.logp),
                     strided(call.ref_logp)};
  if (mask != nullptr) {
    check_mask(logp, *mask, op);
    call.mask = as_rows(*mask);
    call.mask_arg = KlMaskArg{to_mask_dtype(*mask, op), strided(call.mask)};
  }
  return call;
}

// The forward's optional d out / d logp output (acc dtype, shaped like logp), or an empty tensor
// when it is not wanted; its pointer for the launcher is null then.
inline at::Tensor dlogp_output(const at::Tensor& logp, bool with_dlogp) {
  const auto options = logp.options().dtype(acc_scalar_type(logp));
  return with_dlogp ? at::empty(logp.sizes(), options) : at::empty({0}, options);
}

inline void* dlogp_ptr(const at::Tensor& dlogp) { return dlogp.numel() > 0 ? dlogp.data_ptr() : nullptr; }

// The CUDA launchers write no dlogp (their backward recomputes at the GPU's bandwidth).
inline void check_no_dlogp(bool with_dlogp, const char* op) {
  TORCH_CHECK(!with_dlogp, "megalign::", op, ": with_dlogp=True is a CPU-kernel option; on CUDA pass False");
}

// launch(args, out, dlogp); returns (out, dlogp).
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> kl_penalty_fwd_glue(const at::Tensor& logp, const at::Tensor& ref_logp,
                                                       const std::string& kind, bool with_dlogp, Launch&& launch) {
  const KlCall call = prepare_kl(logp, ref_logp, kind, nullptr, "kl_penalty_fwd");
  at::Tensor out = at::empty(logp.sizes(), logp.options().dtype(acc_scalar_type(logp)));
  at::Tensor dlogp = dlogp_output(logp, with_dlogp);
  if (out.numel() > 0) launch(call.args, out.data_ptr(), dlogp_ptr(dlogp));
  return {out, dlogp};
}

// launch(args, grad_view, grad_logp)
template <typename Launch>
at::Tensor kl_penalty_bwd_glue(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& ref_logp,
                               const std::string& kind, Launch&& launch) {
  const KlCall call = prepare_kl(logp, ref_logp, kind, nullptr, "kl_penalty_bwd");
  check_grad(logp, grad, "kl_penalty_bwd");
  const at::Tensor grad2 = as_rows(grad);
  at::Tensor grad_logp = at::empty(logp.sizes(), logp.options());
  if (grad_logp.numel() > 0) launch(call.args, strided(grad2), grad_logp.data_ptr());
  return grad_logp;
}

// launch(args, mask_arg, mean, count, dlogp); returns (mean, count) as 0-d tensors and dlogp.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_masked_mean_fwd_glue(const at::Tensor& logp,
                                                                       const at::Tensor& ref_logp,
                                                                       const at::Tensor& mask, const std::string& kind,
                                                                       bool with_dlogp, Launch&& launch) {
  const KlCall call = prepare_kl(logp, ref_logp, kind, &mask, "kl_masked_mean_fwd");
  at::Tensor mean = at::empty({}, logp.options().dtype(acc_scalar_type(logp)));
  at::Tensor count = at::empty({}, logp.options().dtype(at::kLong));
  at::Tensor dlogp = dlogp_output(logp, with_dlogp);
  launch(call.args, call.mask_arg, mean.data_ptr(), count.data_ptr<int64_t>(), dlogp_ptr(dlogp));
  return {mean, count, dlogp};
}

// launch(args, mask_arg, grad_mean, count, grad_logp)
template <typename Launch>
at::Tensor kl_masked_mean_bwd_glue(const at::Tensor& grad, const at::Tensor& count, const at::Tensor& logp,
                                   const at::Tensor& ref_logp, const at::Tensor& mask, const std::string& kind,
                                   Launch&& launch) {
  const char* op = "kl_masked_mean_bwd";
  const KlCall call = prepare_kl(logp, ref_logp, kind, &mask, op);
  check_same_device(logp, grad, op, "logp", "grad");
  check_same_device(logp, count, op, "logp", "count");
  TORCH_CHECK(grad.numel() == 1, "megalign::", op, ": grad must hold one value, got shape ", grad.sizes());
  check_dtype(grad, acc_scalar_type(logp), op, "grad");
  TORCH_CHECK(count.numel() == 1, "megalign::", op, ": count must hold one value, got shape ", count.sizes());
  check_dtype(count, at::kLong, op, "count");
  const at::Tensor grad1 = grad.contiguous();
  const at::Tensor count1 = count.contiguous();
  at::Tensor grad_logp = at::empty(logp.sizes(), logp.options());
  if (grad_logp.numel() > 0) {
    launch(call.args, call.mask_arg, grad1.data_ptr(), count1.data_ptr<int64_t>(), grad_logp.data_ptr());
  }
  return grad_logp;
}

// ---- policy_loss ------------------------------------------------------------------------------

struct PolicyCall {
  at::Tensor logp, old_logp, advantages, mask, ref_logp;
  PolicyLossArgs args{};
};

inline PolicyCall prepare_policy(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                                 const at::Tensor& mask, double eps_low, double eps_high,
                                 std::optional<double> dual_clip, double beta,
                                 const std::optional<at::Tensor>& ref_logp, const char* op) {
  const DType dtype = to_dtype(logp, op, "logp");
  check_like(logp, old_logp, op, "old_logp");
  check_like(logp, advantages, op, "advantages");
  check_mask(logp, mask, op);
  TORCH_CHECK(eps_low >= 0.0, "megalign::", op, ": eps_low must be >= 0, got ", eps_low);
  TORCH_CHECK(eps_high >= 0.0, "megalign::", op, ": eps_high must be >= 0, got ", eps_high);
  TORCH_CHECK(!dual_clip.has_value() || *dual_clip > 1.0, "megalign::", op, ": dual_clip must be > 1, got ",
              dual_clip.value_or(0.0));
  TORCH_CHECK(beta >= 0.0, "megalign::", op, ": beta must be >= 0, got ", beta);
  TORCH_CHECK(beta == 0.0 || ref_logp.has_value(), "megalign::", op, ": beta = ", beta,
              " > 0 needs ref_logp, got None");
  PolicyCall call;
  call.logp = as_rows(logp);
  call.old_logp = as_rows(old_logp);
  call.advantages = as_rows(advantages);
  call.mask = as_rows(mask);
  StridedView ref_view;
  if (ref_logp.has_value()) {
    check_like(logp, *ref_logp, op, "ref_logp");
    call.ref_logp = as_rows(*ref_logp);
    ref_view = strided(call.ref_logp);
  }
  call.args = PolicyLossArgs{dtype, to_mask_dtype(mask, op), call.logp.size(0), call.logp.size(1),
                             strided(call.logp), strided(call.old_logp), strided(call.advantages),
                             strided(call.mask), ref_view, eps_low, eps_high, dual_clip.value_or(0.0), beta};
  return call;
}

// launch(args, loss, stats, dlogp, loss_sum); returns (loss, fp32 stats[kNumPolicyStats], dlogp).
// loss is the per-token loss, or with sum_loss its sum over the valid tokens (0-d, acc dtype).
// A launcher that reduces it in its own pass (FusedSum: the CPU kernels) then gets loss ==
// nullptr and writes loss_sum, so no per-token loss is stored; the others (loss_sum == nullptr)
// write the per-token loss, which is then summed (0 at masked tokens).
template <bool FusedSum, typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> policy_loss_fwd_glue(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages, const at::Tensor& mask,
    double eps_low, double eps_high, std::optional<double> dual_clip, double beta,
    const std::optional<at::Tensor>& ref_logp, bool with_dlogp, bool sum_loss, Launch&& launch) {
  const PolicyCall call = prepare_policy(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                                         ref_logp, "policy_loss_fwd");
  const auto acc = logp.options().dtype(acc_scalar_type(logp));
  at::Tensor stats = at::empty({kNumPolicyStats}, logp.options().dtype(at::kFloat));
  at::Tensor dlogp = dlogp_output(logp, with_dlogp);
  if (sum_loss && FusedSum) {
    double total = 0.0;
    launch(call.args, nullptr, stats.data_ptr<float>(), dlogp_ptr(dlogp), &total);
    return {at::scalar_tensor(total, acc), stats, dlogp};
  }
  at::Tensor loss = at::empty(logp.sizes(), acc);
  launch(call.args, loss.data_ptr(), stats.data_ptr<float>(), dlogp_ptr(dlogp), nullptr);
  return {sum_loss ? loss.sum() : loss, stats, dlogp};
}

// launch(args, grad_view, grad_logp)
template <typename Launch>
at::Tensor policy_loss_bwd_glue(const at::Tensor& grad, const at::Tensor& logp, const at::Tensor& old_logp,
                                const at::Tensor& advantages, const at::Tensor& mask, double eps_low,
                                double eps_high, std::optional<double> dual_clip, double beta,
                                const std::optional<at::Tensor>& ref_logp, Launch&& launch) {
  const PolicyCall call = prepare_policy(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                                         ref_logp, "policy_loss_bwd");
  check_grad(logp, grad, "policy_loss_bwd");
  const at::Tensor grad2 = as_rows(grad);
  at::Tensor grad_logp = at::empty(logp.sizes(), logp.options());
  if (grad_logp.numel() > 0) launch(call.args, strided(grad2), grad_logp.data_ptr());
  return grad_logp;
}

}  // namespace megalign::torch_glue
