// The Python module `megalign._C`. Importing it runs the static TORCH_LIBRARY_FRAGMENT /
// TORCH_LIBRARY_IMPL registrations of every op in csrc/torch/, which is all Python needs:
// the ops are reached through torch.ops.megalign.*. WITH_CUDA tells Python whether the CUDA
// implementations were compiled in.
#include <Python.h>
#include <torch/library.h>

// Every op's schema goes into this namespace through TORCH_LIBRARY_FRAGMENT(megalign, m) in its own
// file (one file per op); this is the single TORCH_LIBRARY that owns the namespace.
TORCH_LIBRARY(megalign, m) {}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "megalign native kernels", -1, nullptr};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
#ifdef MEGALIGN_WITH_CUDA
  PyModule_AddIntConstant(m, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "WITH_CUDA", 0);
#endif
  return m;
}
