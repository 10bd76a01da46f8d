// Schemas of the token_logprob ops and their CPU implementations.
//
//   token_logprob_partials: per-row softmax statistics (m, s, z_target, t) of one vocab shard.
//   token_logprob_fwd:      the one-shard case plus the O(N) finalize -> (logp, lse, entropy);
//                           its inplace_backward flag is read only by the autograd formula.
//   token_logprob_bwd / token_logprob_bwd_: dL/dlogits of a shard from the saved lse (and
//                           entropy), into a new tensor or into the logits buffer itself.
#include "megalign/token_logprob.h"

#include "token_logprob_checks.h"

namespace megalign::torch_glue::token_logprob {
namespace {

constexpr const char* kPartials = "token_logprob_partials";
constexpr const char* kFwd = "token_logprob_fwd";
constexpr const char* kBwd = "token_logprob_bwd";

at::Tensor partials_cpu_checked(const char* op, const at::Tensor& logits, const at::Tensor& targets,
                                int64_t vocab_start, int64_t vocab_size, double temperature,
                                int64_t ignore_index, bool with_entropy) {
  const at::Tensor x = check_rows(op, logits, targets, temperature);
  check_cpu(x, op, "logits");
  const at::Tensor tgt = targets.contiguous();
  at::Tensor out = at::empty({x.size(0), 4}, x.options().dtype(acc_type(x)));
  const int64_t bad = cpu::token_logprob_partials(
      to_dtype(x, op, "logits"), x.data_ptr(), x.size(0), x.size(1), x.stride(0),
      tgt.data_ptr<int64_t>(), vocab_start, vocab_size, 1.0 / temperature, ignore_index,
      with_entropy, out.data_ptr());
  TORCH_CHECK_INDEX(bad < 0, "megalign::", op, ": targets (flat row ", bad, ") = ",
              tgt.data_ptr<int64_t>()[bad], " is out of range: expected ",
              vocab_size >= 0 ? "0 <= target < " + std::to_string(vocab_size) : std::string("target >= 0"),
              " or ignore_index = ", ignore_index);
  return out;
}

at::Tensor partials_cpu(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                        int64_t vocab_size, double temperature, int64_t ignore_index,
                        bool with_entropy) {
  return partials_cpu_checked(kPartials, logits, targets, vocab_start, vocab_size, temperature,
                              ignore_index, with_entropy);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& logits,
                                                       const at::Tensor& targets,
                                                       double temperature, int64_t ignore_index,
                                                       bool with_entropy,
                                                       bool /*inplace_backward: autograd only*/) {
  const at::Tensor partials = partials_cpu_checked(kFwd, logits, targets, 0, logits.size(-1),
                                                   temperature, ignore_index, with_entropy);
  const int64_t n = partials.size(0);
  at::Tensor logp = at::empty({n}, partials.options());
  at::Tensor lse = at::empty({n}, partials.options());
  at::Tensor entropy = at::empty({with_entropy ? n : 0}, partials.options());
  cpu::token_logprob_finalize(to_dtype(partials, kFwd, "partials"), partials.data_ptr(), n,
                              logp.data_ptr(), lse.data_ptr(),
                              with_entropy ? entropy.data_ptr() : nullptr);
  return {logp, lse, entropy};
}

void bwd_into(const BackwardArgs& a, int64_t vocab_start, double temperature, int64_t ignore_index,
              at::Tensor& grad) {
  cpu::token_logprob_backward(to_dtype(a.logits, kBwd, "logits"), a.logits.data_ptr(),
                              a.logits.size(0), a.logits.size(1), a.logits.stride(0),
                              a.targets.data_ptr<int64_t>(), a.lse.data_ptr(),
                              data_or_null(a.entropy), a.grad_logp.data_ptr(),
                              data_or_null(a.grad_entropy), vocab_start, 1.0 / temperature,
                              ignore_index, grad.data_ptr(), grad.stride(0));
}

at::Tensor bwd_cpu(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                   const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                   const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                   double temperature, int64_t ignore_index) {
  const BackwardArgs a = check_backward(kBwd, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  check_cpu(a.logits, kBwd, "logits");
  at::Tensor grad = at::empty(a.logits.sizes(), a.logits.options());
  bwd_into(a, vocab_start, temperature, ignore_index, grad);
  return grad;
}

void bwd_inplace_cpu(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                     const c10::optional<at::Tensor>& entropy, const at::Tensor& grad_logp,
                     const c10::optional<at::Tensor>& grad_entropy, int64_t vocab_start,
                     double temperature, int64_t ignore_index) {
  check_inplace_layout(logits);
  const BackwardArgs a = check_backward(kBwd, logits, targets, lse, entropy, grad_logp,
                                        grad_entropy, temperature);
  check_cpu(a.logits, kBwd, "logits");
  bwd_into(a, vocab_start, temperature, ignore_index, logits);
}

}  // namespace
}  // namespace megalign::torch_glue::token_logprob

TORCH_LIBRARY_FRAGMENT(megalign, m) {
  m.def(
      "token_logprob_partials(Tensor logits, Tensor targets, int vocab_start, int vocab_size, "
      "float temperature, int ignore_index, bool with_entropy) -> Tensor");
  m.def(
      "token_logprob_fwd(Tensor logits, Tensor targets, float temperature, int ignore_index, "
      "bool with_entropy, bool inplace_backward) -> (Tensor, Tensor, Tensor)");
  m.def(
      "token_logprob_bwd(Tensor logits, Tensor targets, Tensor lse, Tensor? entropy, "
      "Tensor grad_logp, Tensor? grad_entropy, int vocab_start, float temperature, "
      "int ignore_index) -> Tensor");
  m.def(
      "token_logprob_bwd_(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor? entropy, "
      "Tensor grad_logp, Tensor? grad_entropy, int vocab_start, float temperature, "
      "int ignore_index) -> ()");
}

TORCH_LIBRARY_IMPL(megalign, CPU, m) {
  namespace g = megalign::torch_glue::token_logprob;
  m.impl("token_logprob_partials", &g::partials_cpu);
  m.impl("token_logprob_fwd", &g::fwd_cpu);
  m.impl("token_logprob_bwd", &g::bwd_cpu);
  m.impl("token_logprob_bwd_", &g::bwd_inplace_cpu);
}
