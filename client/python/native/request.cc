#include "request.h"

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "mhc/status.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::client::python {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// A conversion failed: drops the Python error for a status naming `what`.
absl::Status Invalid(absl::string_view what, absl::string_view expected) {
  PyErr_Clear();
  return absl::InvalidArgumentError(
      absl::StrCat("native call: ", what, ": expected ", expected));
}

// CPython keeps the UTF-8 of a str with it: no conversion per call.
absl::StatusOr<absl::string_view> Str(PyObject* object,
                                      absl::string_view what) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_Check(object)
                         ? PyUnicode_AsUTF8AndSize(object, &size)
                         : nullptr;
  if (data == nullptr) return Invalid(what, "a str");
  return absl::string_view(data, static_cast<size_t>(size));
}

absl::StatusOr<int64_t> Int(PyObject* object, absl::string_view what) {
  if (!PyLong_Check(object)) return Invalid(what, "an int");
  const long long value = PyLong_AsLongLong(object);
  if (value == -1 && PyErr_Occurred()) return Invalid(what, "a 64-bit int");
  return value;
}

absl::StatusOr<uint64_t> Size(PyObject* object, absl::string_view what) {
  MHC_ASSIGN_OR_RETURN(int64_t value, Int(object, what));
  if (value < 0) return Invalid(what, "a size >= 0");
  return static_cast<uint64_t>(value);
}

// The length of a tuple or list of `size` items (any size when `size` < 0).
absl::StatusOr<Py_ssize_t> SequenceSize(PyObject* sequence, Py_ssize_t size,
                                        absl::string_view what) {
  const Py_ssize_t actual = PyTuple_Check(sequence)  ? PyTuple_Size(sequence)
                            : PyList_Check(sequence) ? PyList_Size(sequence)
                                                     : -1;
  if (actual < 0 || (size >= 0 && actual != size)) {
    return Invalid(what, size >= 0 ? absl::StrCat("a tuple of ", size)
                                   : std::string("a tuple or list"));
  }
  return actual;
}

// Item `i` of a tuple or list whose size was checked (a borrowed reference).
PyObject* Item(PyObject* sequence, Py_ssize_t i) {
  return PyTuple_Check(sequence) ? PyTuple_GetItem(sequence, i)
                                 : PyList_GetItem(sequence, i);
}

// Compute messages have at most a dozen fields: a scan beats building the
// std::string that Descriptor::FindFieldByName takes.
const FieldDescriptor* FieldNamed(const Descriptor& type,
                                  absl::string_view name) {
  for (int i = 0; i < type.field_count(); ++i) {
    if (type.field(i)->name() == name) return type.field(i);
  }
  return nullptr;
}

// The TensorRef field that `entry` (a tuple of `arity` starting with field
// name, dtype and shape) names, with its dtype and shape set.
absl::StatusOr<v1::TensorRef*> SetTensorHeader(const ComputeMethod& method,
                                               PyObject* entry,
                                               Py_ssize_t arity,
                                               Message& request) {
  MHC_RETURN_IF_ERROR(SequenceSize(entry, arity, "tensor").status());
  MHC_ASSIGN_OR_RETURN(absl::string_view name,
                       Str(Item(entry, 0), "tensor name"));
  const FieldDescriptor* field = FieldNamed(*request.GetDescriptor(), name);
  if (field == nullptr || field->is_repeated() ||
      field->message_type() != v1::TensorRef::descriptor()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "native call: ", method.name(), " has no tensor '", name, "'"));
  }
  auto* ref = static_cast<v1::TensorRef*>(
      request.GetReflection()->MutableMessage(&request, field));
  MHC_ASSIGN_OR_RETURN(int64_t dtype, Int(Item(entry, 1), "dtype"));
  if (!v1::DType_IsValid(static_cast<int>(dtype))) {
    return Invalid("dtype", "a DType value");
  }
  ref->set_dtype(static_cast<v1::DType>(dtype));
  PyObject* shape = Item(entry, 2);
  MHC_ASSIGN_OR_RETURN(Py_ssize_t rank, SequenceSize(shape, -1, "shape"));
  ref->mutable_shape()->Reserve(static_cast<int>(rank));
  for (Py_ssize_t i = 0; i < rank; ++i) {
    MHC_ASSIGN_OR_RETURN(int64_t dim, Int(Item(shape, i), "shape"));
    ref->add_shape(dim);
  }
  return ref;
}

absl::Status SetTensor(const ComputeMethod& method, PyObject* entry,
                       Message& request) {
  MHC_ASSIGN_OR_RETURN(v1::TensorRef * ref,
                       SetTensorHeader(method, entry, 6, request));
  if (Item(entry, 3) == Py_None) {  // an empty tensor: no bytes, no region
    ref->mutable_inline_data();
    return absl::OkStatus();
  }
  MHC_ASSIGN_OR_RETURN(absl::string_view region, Str(Item(entry, 3), "region"));
  MHC_ASSIGN_OR_RETURN(uint64_t offset, Size(Item(entry, 4), "offset"));
  MHC_ASSIGN_OR_RETURN(uint64_t byte_size, Size(Item(entry, 5), "byte_size"));
  v1::SharedMemoryRef* shm = ref->mutable_shm();
  shm->mutable_region()->assign(region.data(), region.size());
  shm->set_offset(offset);
  shm->set_byte_size(byte_size);
  return absl::OkStatus();
}

// A CUDA tensor (field, dtype, shape, address, byte_size) placed through
// `table`; `placed` false when its allocation is not registered.
absl::Status SetCudaTensor(const ComputeMethod& method, PyObject* entry,
                           CudaRegionTable& table, CudaRegionTable::Hold& hold,
                           bool& placed, Message& request) {
  MHC_ASSIGN_OR_RETURN(v1::TensorRef * ref,
                       SetTensorHeader(method, entry, 5, request));
  MHC_ASSIGN_OR_RETURN(uint64_t address, Size(Item(entry, 3), "address"));
  MHC_ASSIGN_OR_RETURN(uint64_t byte_size, Size(Item(entry, 4), "byte_size"));
  if (byte_size == 0) {  // an empty tensor: no bytes, no region
    ref->mutable_inline_data();
    return absl::OkStatus();
  }
  MHC_ASSIGN_OR_RETURN(
      placed, table.Place(address, byte_size, hold, *ref->mutable_shm()));
  return absl::OkStatus();
}

absl::Status SetOutput(const ComputeMethod& method, PyObject* entry,
                       Message& request) {
  MHC_RETURN_IF_ERROR(SequenceSize(entry, 4, "output").status());
  MHC_ASSIGN_OR_RETURN(absl::string_view name,
                       Str(Item(entry, 0), "output name"));
  MHC_ASSIGN_OR_RETURN(absl::string_view region, Str(Item(entry, 1), "region"));
  MHC_ASSIGN_OR_RETURN(uint64_t offset, Size(Item(entry, 2), "offset"));
  MHC_ASSIGN_OR_RETURN(uint64_t byte_size, Size(Item(entry, 3), "byte_size"));
  v1::SharedMemoryRef& place =
      (*method.MutableOutputRegions(request))[std::string(name)];
  place.mutable_region()->assign(region.data(), region.size());
  place.set_offset(offset);
  place.set_byte_size(byte_size);
  return absl::OkStatus();
}

absl::Status SetFlag(const ComputeMethod& method, PyObject* entry,
                     Message& request) {
  MHC_RETURN_IF_ERROR(SequenceSize(entry, 2, "flag").status());
  MHC_ASSIGN_OR_RETURN(absl::string_view name,
                       Str(Item(entry, 0), "flag name"));
  PyObject* value = Item(entry, 1);
  if (value == Py_None) return absl::OkStatus();  // unset, as in Python
  const FieldDescriptor* field = FieldNamed(*request.GetDescriptor(), name);
  if (field == nullptr || field->message_type() != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "native call: ", method.name(), " has no flag '", name, "'"));
  }
  const Reflection& reflection = *request.GetReflection();
  if (field->is_repeated()) {
    if (field->cpp_type() != FieldDescriptor::CPPTYPE_INT64) {
      return Invalid(name, "a scalar");
    }
    MHC_ASSIGN_OR_RETURN(Py_ssize_t count, SequenceSize(value, -1, name));
    for (Py_ssize_t i = 0; i < count; ++i) {
      MHC_ASSIGN_OR_RETURN(int64_t v, Int(Item(value, i), name));
      reflection.AddInt64(&request, field, v);
    }
    return absl::OkStatus();
  }
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_BOOL: {
      const int truth = PyObject_IsTrue(value);
      if (truth < 0) return Invalid(name, "a bool");
      reflection.SetBool(&request, field, truth != 0);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      MHC_ASSIGN_OR_RETURN(int64_t v, Int(value, name));
      reflection.SetInt64(&request, field, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT32: {
      MHC_ASSIGN_OR_RETURN(int64_t v, Int(value, name));
      reflection.SetInt32(&request, field, static_cast<int32_t>(v));
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      MHC_ASSIGN_OR_RETURN(int64_t v, Int(value, name));
      reflection.SetEnumValue(&request, field, static_cast<int>(v));
      return absl::OkStatus();
    }
    default:
      return Invalid(name, "a bool, int or enum flag");
  }
}

absl::Status SetLayerAndFlags(const ComputeMethod& method, PyObject* layer,
                              PyObject* flags, Message& request) {
  MHC_ASSIGN_OR_RETURN(absl::string_view layer_name, Str(layer, "layer"));
  method.MutableLayer(request)->assign(layer_name.data(), layer_name.size());
  MHC_ASSIGN_OR_RETURN(Py_ssize_t flag_count, SequenceSize(flags, -1, "flags"));
  for (Py_ssize_t i = 0; i < flag_count; ++i) {
    MHC_RETURN_IF_ERROR(SetFlag(method, Item(flags, i), request));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FillRequest(const ComputeMethod& method, PyObject* layer,
                         PyObject* tensors, PyObject* outputs, PyObject* flags,
                         Message& request) {
  MHC_RETURN_IF_ERROR(SetLayerAndFlags(method, layer, flags, request));
  MHC_ASSIGN_OR_RETURN(Py_ssize_t tensor_count,
                       SequenceSize(tensors, -1, "tensors"));
  for (Py_ssize_t i = 0; i < tensor_count; ++i) {
    MHC_RETURN_IF_ERROR(SetTensor(method, Item(tensors, i), request));
  }
  MHC_ASSIGN_OR_RETURN(Py_ssize_t output_count,
                       SequenceSize(outputs, -1, "outputs"));
  for (Py_ssize_t i = 0; i < output_count; ++i) {
    MHC_RETURN_IF_ERROR(SetOutput(method, Item(outputs, i), request));
  }
  return absl::OkStatus();
}

absl::Status FillCudaRequest(const ComputeMethod& method, PyObject* layer,
                             PyObject* tensors, PyObject* outputs,
                             PyObject* flags, CudaRegionTable& table,
                             CudaRegionTable::Hold& hold, bool& placed,
                             Message& request) {
  placed = true;
  MHC_ASSIGN_OR_RETURN(Py_ssize_t tensor_count,
                       SequenceSize(tensors, -1, "tensors"));
  for (Py_ssize_t i = 0; i < tensor_count && placed; ++i) {
    MHC_RETURN_IF_ERROR(
        SetCudaTensor(method, Item(tensors, i), table, hold, placed, request));
  }
  MHC_ASSIGN_OR_RETURN(Py_ssize_t output_count,
                       SequenceSize(outputs, -1, "outputs"));
  for (Py_ssize_t i = 0; i < output_count && placed; ++i) {
    PyObject* entry = Item(outputs, i);
    MHC_RETURN_IF_ERROR(SequenceSize(entry, 3, "output").status());
    MHC_ASSIGN_OR_RETURN(absl::string_view name,
                         Str(Item(entry, 0), "output name"));
    MHC_ASSIGN_OR_RETURN(uint64_t address, Size(Item(entry, 1), "address"));
    MHC_ASSIGN_OR_RETURN(uint64_t byte_size, Size(Item(entry, 2), "byte_size"));
    MHC_ASSIGN_OR_RETURN(placed, table.Place(address, byte_size, hold,
                                             (*method.MutableOutputRegions(
                                                 request))[std::string(name)]));
  }
  if (!placed) return absl::OkStatus();
  return SetLayerAndFlags(method, layer, flags, request);
}

absl::Status CheckOutputsInPlace(const ComputeMethod& method, Message& request,
                                 const Message& response) {
  const Descriptor& type = *response.GetDescriptor();
  const Reflection& reflection = *response.GetReflection();
  for (const auto& [name, place] : *method.MutableOutputRegions(request)) {
    const FieldDescriptor* field = FieldNamed(type, name);
    const v1::TensorRef* ref = nullptr;
    if (field != nullptr && !field->is_repeated() &&
        field->message_type() == v1::TensorRef::descriptor() &&
        reflection.HasField(response, field)) {
      ref = static_cast<const v1::TensorRef*>(
          &reflection.GetMessage(response, field));
    }
    if (ref == nullptr || !ref->has_shm() ||
        ref->shm().region() != place.region() ||
        ref->shm().offset() != place.offset()) {
      return absl::InternalError(absl::StrCat(
          "output '", name, "' did not come back in place (region '",
          place.region(), "' at offset ", place.offset(), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mhc::client::python
