// Builds compute requests from the plain Python values of the native call
// path (see mhc_client/native.py) and checks their answers. Called with the
// GIL held (building) and released (checking).
#ifndef MHC_CLIENT_PYTHON_NATIVE_REQUEST_H_
#define MHC_CLIENT_PYTHON_NATIVE_REQUEST_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "absl/status/status.h"
#include "cuda_regions.h"
#include "google/protobuf/message.h"
#include "mhc/client/compute_method.h"

namespace mhc::client::python {

// Fills `request` of `method` from (each "tuple" may also be a list):
//   layer:   str
//   tensors: tuple of (field: str, dtype: int, shape: tuple of int,
//            region: str or None, offset: int, byte_size: int); region None
//            is an empty tensor (no bytes to name)
//   outputs: tuple of (output: str, region: str, offset: int, byte_size: int)
//   flags:   tuple of (field: str, value: bool, int, tuple of int or None)
// INVALID_ARGUMENT (no Python error left set) when a value does not fit.
absl::Status FillRequest(const ComputeMethod& method, PyObject* layer,
                         PyObject* tensors, PyObject* outputs, PyObject* flags,
                         google::protobuf::Message& request);

// As FillRequest, for CUDA tensors named by device address:
//   tensors: tuple of (field: str, dtype: int, shape: tuple of int,
//            address: int, byte_size: int); byte_size 0 is an empty tensor
//   outputs: tuple of (output: str, address: int, byte_size: int)
// Each tensor's region and offset come from `table`, its allocation held in
// `hold`. `placed` false (the request half built) when an allocation is not
// in the table: the caller registers it and calls again.
absl::Status FillCudaRequest(const ComputeMethod& method, PyObject* layer,
                             PyObject* tensors, PyObject* outputs,
                             PyObject* flags, CudaRegionTable& table,
                             CudaRegionTable::Hold& hold, bool& placed,
                             google::protobuf::Message& request);

// INTERNAL unless every output the request placed in a region came back
// as a reference to that place (so the caller's views hold the outputs).
absl::Status CheckOutputsInPlace(const ComputeMethod& method,
                                 google::protobuf::Message& request,
                                 const google::protobuf::Message& response);

}  // namespace mhc::client::python

#endif  // MHC_CLIENT_PYTHON_NATIVE_REQUEST_H_
