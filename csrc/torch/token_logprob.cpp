// Schemas of the token_logprob ops and their CPU implementations (shared glue in
// token_logprob_glue.h).
//
//   token_logprob_partials: per-row softmax statistics (m, s, z_target, t) of one vocab shard.
//   token_logprob_fwd:      the one-shard case plus the O(N) finalize -> (logp, lse, entropy);
//                           its inplace_backward flag is read only by the autograd formula.
//   token_logprob_bwd / token_logprob_bwd_: dL/dlogits of a shard from the saved lse (and
//                           entropy), into a new tensor or into the logits buffer itself.
#include <cstdint>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "megalign/token_logprob.h"
#include "token_logprob_glue.h"

namespace megalign::torch_glue::token_logprob {
namespace {

struct CpuBackend {
  struct Guard {
    explicit Guard(c10::Device) {}
  };
  static void check_device(const at::Tensor& t, const char* op, const char* arg) { check_cpu(t, op, arg); }

  // Raises an IndexError naming targets and the first out-of-range row.
  static void partials(const char* op, DType dtype, const void* logits, int64_t n_rows, int64_t vocab,
                       int64_t row_stride, const int64_t* targets, int64_t vocab_start,
                       int64_t vocab_size, double inv_temperature, int64_t ignore_index,
                       bool with_entropy, void* out) {
    const int64_t bad = cpu::token_logprob_partials(dtype, logits, n_rows, vocab, row_stride, targets,
                                                    vocab_start, vocab_size, inv_temperature,
                                                    ignore_index, with_entropy, out);
    TORCH_CHECK_INDEX(bad < 0, "megalign::", op, ": targets (flat row ", bad, ") = ",
                      bad < 0 ? 0 : targets[bad], " is out of range: expected ",
                      vocab_size >= 0 ? "0 <= target < " + std::to_string(vocab_size)
                                      : std::string("target >= 0"),
                      " or ignore_index = ", ignore_index);
  }
  static void finalize(const char*, DType dtype, const void* partials, int64_t n_rows, void* logp,
                       void* lse, void* entropy) {
    cpu::token_logprob_finalize(dtype, partials, n_rows, logp, lse, entropy);
  }
  template <class... Args> static void backward(const char*, Args... args) {
    cpu::token_logprob_backward(args...);
  }

  // The [N, V] gradient, the one large buffer of the op (2.4 GB at N = 4096, V = 151936 fp32).
  // The backward is its first toucher, and with 4 KiB pages the page faults cost more than the
  // arithmetic (measured on a 2-core VM: 0.40 s of faults to 0.10 s of kernel for 622 MB), so
  // its 2 MiB-aligned interior is offered to transparent huge pages first (Linux, where THP is
  // "madvise" or "always"; advisory, nothing changes elsewhere).
  static at::Tensor new_grad(const at::Tensor& logits) {
    at::Tensor grad = at::empty(logits.sizes(), logits.options());
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    const auto begin = reinterpret_cast<uintptr_t>(grad.data_ptr());
    const uintptr_t end = begin + static_cast<uintptr_t>(grad.numel()) * grad.element_size();
    const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t hi = end & ~(kHuge - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
    return grad;
  }
};

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
  g::register_impls<g::CpuBackend>(m);
}
