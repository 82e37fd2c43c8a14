// SPDX-License-Identifier: Apache-2.0
//
// DDTREE_PYTHON_MODULE(doc): defines the extension's (empty) Python module, so that
// `import vllm_ddtree.<TORCH_EXTENSION_NAME>` loads the shared library and runs its
// TORCH_LIBRARY registrations. Use once per extension, after those registrations.
#pragma once

#include <Python.h>

#define DDTREE_CONCAT_IMPL(a, b) a##b
#define DDTREE_CONCAT(a, b) DDTREE_CONCAT_IMPL(a, b)
#define DDTREE_STRINGIFY_IMPL(a) #a
#define DDTREE_STRINGIFY(a) DDTREE_STRINGIFY_IMPL(a)

#define DDTREE_PYTHON_MODULE(doc)                                        \
  PyMODINIT_FUNC DDTREE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {    \
    static struct PyModuleDef module = {                                 \
        PyModuleDef_HEAD_INIT, DDTREE_STRINGIFY(TORCH_EXTENSION_NAME),   \
        doc, -1, nullptr,                                                \
    };                                                                   \
    return PyModule_Create(&module);                                     \
  }
