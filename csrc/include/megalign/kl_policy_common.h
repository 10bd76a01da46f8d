// Framework-free pieces shared by the kl_penalty and policy_loss launchers: how a token mask is
// read (any dtype, nonzero = valid token) and how a strided [rows, cols] operand is addressed.
//
// The torch glue views every operand of shape [..., T] as [rows, T] (a view when the strides
// allow it, which covers slices such as logp[:, :-1] and the stride-0 gradients autograd hands to
// backward), so the kernels take a data pointer plus one row and one column stride per operand
// and never need a contiguous copy. Outputs are always freshly allocated and dense.
#pragma once

#include <cstdint>
#include <type_traits>

#include "megalign/common.h"
#include "megalign/math/exp.h"

namespace megalign {

// Element type of a token mask. Masks keep 0/1 semantics whatever their dtype: an element is a
// valid token when it is nonzero (a float mask is not a weight). bool and uint8 share kBool.
enum class MaskDType : int { kBool = 0, kInt32, kInt64, kFloat32, kFloat64, kBFloat16, kFloat16 };

MEGALIGN_HD_INLINE bool mask_valid(uint8_t m) { return m != 0; }
MEGALIGN_HD_INLINE bool mask_valid(int32_t m) { return m != 0; }
MEGALIGN_HD_INLINE bool mask_valid(int64_t m) { return m != 0; }
MEGALIGN_HD_INLINE bool mask_valid(float m) { return m != 0.0f; }
MEGALIGN_HD_INLINE bool mask_valid(double m) { return m != 0.0; }
// +0 and -0 are the only 16-bit patterns equal to zero.
MEGALIGN_HD_INLINE bool mask_valid(bf16 m) { return (m.bits & 0x7FFFu) != 0; }
MEGALIGN_HD_INLINE bool mask_valid(fp16 m) { return (m.bits & 0x7FFFu) != 0; }

#define MEGALIGN_DISPATCH_MASK_CASE(enum_value, type, ...) \
  case ::megalign::MaskDType::enum_value: {                \
    using mask_t = type;                                   \
    __VA_ARGS__();                                         \
    break;                                                 \
  }

// Invoke a generic lambda with `mask_t` bound to the C++ storage type of `mdtype`.
#define MEGALIGN_DISPATCH_MASK(mdtype, op_name, ...)                                  \
  switch (mdtype) {                                                                   \
    MEGALIGN_DISPATCH_MASK_CASE(kBool, uint8_t, __VA_ARGS__)                          \
    MEGALIGN_DISPATCH_MASK_CASE(kInt32, int32_t, __VA_ARGS__)                         \
    MEGALIGN_DISPATCH_MASK_CASE(kInt64, int64_t, __VA_ARGS__)                         \
    MEGALIGN_DISPATCH_MASK_CASE(kFloat32, float, __VA_ARGS__)                         \
    MEGALIGN_DISPATCH_MASK_CASE(kFloat64, double, __VA_ARGS__)                        \
    MEGALIGN_DISPATCH_MASK_CASE(kBFloat16, ::megalign::bf16, __VA_ARGS__)             \
    MEGALIGN_DISPATCH_MASK_CASE(kFloat16, ::megalign::fp16, __VA_ARGS__)              \
    default:                                                                          \
      throw std::invalid_argument(std::string(op_name) + ": unsupported mask dtype"); \
  }

// One read-only operand viewed as [rows, cols]: element (r, c) is at data + r*row_stride +
// c*col_stride (in elements). A null `data` marks an absent optional operand.
struct StridedView {
  const void* data = nullptr;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

MEGALIGN_HD_INLINE int64_t element_offset(const StridedView& v, int64_t r, int64_t c) {
  return r * v.row_stride + c * v.col_stride;
}

// True when the view is the dense row-major layout, so element (r, c) sits at r*cols + c.
inline bool is_dense(const StridedView& v, int64_t cols) {
  return v.data == nullptr || (v.col_stride == 1 && v.row_stride == cols);
}

// Host-side: invokes fn(std::bool_constant<flag>{}) so a runtime flag (dense layout, optional
// operand present) becomes a template argument of the kernel.
template <typename Fn>
void dispatch_bool(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

template <typename T>
MEGALIGN_HD_INLINE acc_t<T> load_acc(const StridedView& v, int64_t offset) {
  return to_acc(static_cast<const T*>(v.data)[offset]);
}

template <typename M>
MEGALIGN_HD_INLINE bool load_valid(const StridedView& v, int64_t offset) {
  return mask_valid(static_cast<const M*>(v.data)[offset]);
}

}  // namespace megalign
