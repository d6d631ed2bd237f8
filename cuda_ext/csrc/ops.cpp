// Op schemas of the zensync CUDA extension (namespace zensync_cuda, reached from Python as
// torch.ops.zensync_cuda.<op>) and the Python module stub that loads them.
//
// One op name, one implementation per device (the pytorch/extension-cpp layout): this file declares
// the schemas; each csrc/cuda/<algorithm>.cu registers its CUDA implementation with
// TORCH_LIBRARY_IMPL(zensync_cuda, CUDA, m). CPU tensors are served by zensync.kernels.cpu (numba),
// so no CPU implementation is registered here. zensync/kernels/cuda.py is the only caller; each
// op is the device twin of the function of the same name in zensync/kernels/reference.py.
#include <Python.h>
#include <torch/library.h>

// `import zensync_cuda_ext` loads this shared library, whose static initializers register the ops;
// the module itself is empty.
#define ZENSYNC_CONCAT(a, b) a##b
#define ZENSYNC_PYINIT(name) ZENSYNC_CONCAT(PyInit_, name)
#define ZENSYNC_STR(name) #name
#define ZENSYNC_NAME(name) ZENSYNC_STR(name)

extern "C" PyObject* ZENSYNC_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      ZENSYNC_NAME(TORCH_EXTENSION_NAME),  // name
      "zensync CUDA kernels; the ops live in torch.ops.zensync_cuda",
      -1,       // no per-interpreter state
      nullptr,  // no methods
  };
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(zensync_cuda, m) {
  // Partition fields are passed one by one (zensync.types.Partition); keys are 32-bit Feistel keys.
  // parallel_slots / serial_slots: r1 / r2 per owner, 0 = automatic. Returns (items, positions, counts).
  m.def(
      "bucket_nonzero(Tensor x2d, int num_items, int num_owners, int range_len, int half_bits, int[] keys, "
      "bool hashed, int num_hashes, int parallel_slots, int serial_slots, int seed) -> (Tensor, Tensor, Tensor)");
  // bitmap_encode and scatter_add also return the index of their first index out of range (the input's
  // length when none is): zensync/kernels/cuda.py raises from it (common.cuh: OutOfRangeCheck).
  m.def("bitmap_encode(Tensor positions, int length) -> (Tensor, Tensor)");
  m.def("bitmap_decode(Tensor words, int length) -> Tensor");
  m.def("topk(Tensor magnitudes, int k) -> Tensor");
  m.def("sampled_topk(Tensor magnitudes, int k, float threshold, float relax_factor, int max_tries) -> Tensor");
  m.def("scatter_add(Tensor indices, Tensor values, int numel) -> (Tensor, Tensor)");
  m.def("pack_bits(Tensor codes, int bits) -> Tensor");
  m.def("unpack_bits(Tensor packed, int bits, int numel) -> Tensor");
}
