// The Python module `megalign._C`. Importing it runs the static TORCH_LIBRARY_FRAGMENT /
// TORCH_LIBRARY_IMPL registrations of every op in csrc/torch/, which is all Python needs:
// the ops are reached through torch.ops.megalign.*. WITH_CUDA tells Python whether the CUDA
// implementations were compiled in; cpu_isa() which vector ISA the CPU kernels run with.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>

#include "megalign/cpu_isa.h"

// Every op's schema goes into this namespace through TORCH_LIBRARY_FRAGMENT(megalign, m) in its own
// file (one file per op); this is the single TORCH_LIBRARY that owns the namespace.
TORCH_LIBRARY(megalign, m) {}

namespace {

// cpu_isa() -> "avx512" | "avx2" | "baseline"; ValueError for a bad MEGALIGN_CPU_ISA.
PyObject* cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(megalign::cpu::cpu_isa_name());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyMethodDef kMethods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS, "The vector ISA the CPU kernels run with: avx512, avx2 or baseline."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "megalign native kernels", -1, kMethods};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
#ifdef MEGALIGN_WITH_CUDA
  PyModule_AddIntConstant(m, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "WITH_CUDA", 0);
#endif
  return m;
}
