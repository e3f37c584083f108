#include "cuda_regions.h"

#include <utility>

#include "cuda_driver.h"

namespace mhc::client::python {

void CudaRegionTable::Add(uint64_t buffer_id, uint64_t base,
                          std::string region) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& entry = entries_[buffer_id];
  entry.region = std::move(region);
  entry.base = base;
  entry.last_use = ++clock_;
}

void CudaRegionTable::Remove(uint64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(buffer_id);
}

bool CudaRegionTable::RemoveIfIdle(uint64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(buffer_id);
  if (it == entries_.end()) return true;
  if (it->second.calls > 0) return false;
  entries_.erase(it);
  return true;
}

void CudaRegionTable::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

absl::StatusOr<bool> CudaRegionTable::Place(uint64_t address, uint64_t bytes,
                                            Hold& hold,
                                            v1::SharedMemoryRef& place) {
  absl::StatusOr<CudaAllocation> allocation = AllocationOf(address);
  if (!allocation.ok()) return allocation.status();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(allocation->buffer_id);
  if (it == entries_.end()) return false;
  Entry& entry = it->second;
  place.set_region(entry.region);
  place.set_offset(address - entry.base);
  place.set_byte_size(bytes);
  entry.last_use = ++clock_;
  ++entry.calls;
  hold.buffer_ids_.push_back(allocation->buffer_id);
  return true;
}

uint64_t CudaRegionTable::LastUse(uint64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(buffer_id);
  return it == entries_.end() ? 0 : it->second.last_use;
}

bool CudaRegionTable::InUse(uint64_t buffer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(buffer_id);
  return it != entries_.end() && it->second.calls > 0;
}

void CudaRegionTable::Release(const std::vector<uint64_t>& buffer_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t buffer_id : buffer_ids) {
    auto it = entries_.find(buffer_id);
    if (it != entries_.end()) --it->second.calls;
  }
}

namespace {

struct TableObject {
  PyObject_HEAD CudaRegionTable* table;
};

PyTypeObject* table_type = nullptr;

CudaRegionTable& TableOf(PyObject* self) {
  return *reinterpret_cast<TableObject*>(self)->table;
}

PyObject* TableNew(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = PyType_GenericNew(type, nullptr, nullptr);
  if (self != nullptr) {
    reinterpret_cast<TableObject*>(self)->table = new CudaRegionTable;
  }
  return self;
}

void TableDealloc(PyObject* self) {
  delete reinterpret_cast<TableObject*>(self)->table;
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free))(self);
  Py_DECREF(type);
}

PyObject* TableAdd(PyObject* self, PyObject* args) {
  unsigned long long buffer_id = 0;
  unsigned long long base = 0;
  const char* region = nullptr;
  if (!PyArg_ParseTuple(args, "KKs", &buffer_id, &base, &region)) {
    return nullptr;
  }
  TableOf(self).Add(buffer_id, base, region);
  Py_RETURN_NONE;
}

// The buffer id argument of the one-argument methods.
bool BufferId(PyObject* arg, uint64_t& buffer_id) {
  buffer_id = PyLong_AsUnsignedLongLong(arg);
  return !PyErr_Occurred();
}

PyObject* TableRemove(PyObject* self, PyObject* arg) {
  uint64_t buffer_id = 0;
  if (!BufferId(arg, buffer_id)) return nullptr;
  TableOf(self).Remove(buffer_id);
  Py_RETURN_NONE;
}

PyObject* TableRemoveIfIdle(PyObject* self, PyObject* arg) {
  uint64_t buffer_id = 0;
  if (!BufferId(arg, buffer_id)) return nullptr;
  return PyBool_FromLong(TableOf(self).RemoveIfIdle(buffer_id));
}

PyObject* TableClear(PyObject* self, PyObject*) {
  TableOf(self).Clear();
  Py_RETURN_NONE;
}

PyObject* TableLastUse(PyObject* self, PyObject* arg) {
  uint64_t buffer_id = 0;
  if (!BufferId(arg, buffer_id)) return nullptr;
  return PyLong_FromUnsignedLongLong(TableOf(self).LastUse(buffer_id));
}

PyObject* TableInUse(PyObject* self, PyObject* arg) {
  uint64_t buffer_id = 0;
  if (!BufferId(arg, buffer_id)) return nullptr;
  return PyBool_FromLong(TableOf(self).InUse(buffer_id));
}

PyMethodDef table_methods[] = {
    {"add", TableAdd, METH_VARARGS,
     "add(buffer_id, base, region): the allocation is registered as region"},
    {"remove", TableRemove, METH_O, "remove(buffer_id)"},
    {"remove_if_idle", TableRemoveIfIdle, METH_O,
     "remove_if_idle(buffer_id): removes it unless a call in flight names "
     "it; whether it is gone"},
    {"clear", TableClear, METH_NOARGS, "forgets every allocation"},
    {"last_use", TableLastUse, METH_O,
     "last_use(buffer_id): the clock tick of its last use by a call"},
    {"in_use", TableInUse, METH_O,
     "in_use(buffer_id): whether a call in flight names it"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot table_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("CudaRegionTable(): a session's registered CUDA "
                       "allocations, for Connection.compute_cuda")},
    {Py_tp_new, reinterpret_cast<void*>(TableNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(TableDealloc)},
    {Py_tp_methods, table_methods},
    {0, nullptr}};

PyType_Spec table_spec = {"mhc_client._native.CudaRegionTable",
                          sizeof(TableObject), 0, Py_TPFLAGS_DEFAULT,
                          table_slots};

}  // namespace

PyObject* NewCudaRegionTableType() {
  PyObject* type = PyType_FromSpec(&table_spec);
  if (type != nullptr) {
    table_type = reinterpret_cast<PyTypeObject*>(type);
    Py_INCREF(type);  // ours, beside the module's
  }
  return type;
}

CudaRegionTable* CudaRegionTableOf(PyObject* object) {
  if (table_type == nullptr || !PyObject_TypeCheck(object, table_type)) {
    PyErr_SetString(PyExc_TypeError, "expected a CudaRegionTable");
    return nullptr;
  }
  return reinterpret_cast<TableObject*>(object)->table;
}

}  // namespace mhc::client::python
