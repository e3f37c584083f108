// The CUDA allocations that a shared-memory session registered as regions,
// by the driver's buffer id, so that the native call path names a tensor's
// region and offset without Python (mhc_client/torch_transport.py). The
// Python session decides what is registered and unregistered
// (mhc_client/shm.py) and keeps this table in step; the table tells it which
// allocations calls in flight name and which were used least recently.
#ifndef MHC_CLIENT_PYTHON_NATIVE_CUDA_REGIONS_H_
#define MHC_CLIENT_PYTHON_NATIVE_CUDA_REGIONS_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "mhc/v1/tensor.pb.h"

namespace mhc::client::python {

class CudaRegionTable {
 public:
  // The allocations one call names: registered until the call ends.
  class Hold {
   public:
    explicit Hold(CudaRegionTable& table) : table_(table) {}
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { table_.Release(buffer_ids_); }

   private:
    friend class CudaRegionTable;
    CudaRegionTable& table_;
    std::vector<uint64_t> buffer_ids_;
  };

  void Add(uint64_t buffer_id, uint64_t base, std::string region);
  void Remove(uint64_t buffer_id);
  // Removes the allocation unless a call in flight names it; whether it
  // is gone. Atomic with Place, so an allocation chosen for eviction is
  // never named by a call that the eviction then races.
  bool RemoveIfIdle(uint64_t buffer_id);
  void Clear();
  // Fills `place` with the region and offset of [address, address + bytes)
  // and adds its allocation to `hold`; false (nothing filled) when the
  // allocation is not in the table.
  absl::StatusOr<bool> Place(uint64_t address, uint64_t bytes, Hold& hold,
                             v1::SharedMemoryRef& place);
  // A clock tick of the allocation's last Place (0: never, or not here).
  uint64_t LastUse(uint64_t buffer_id) const;
  // Whether a call in flight names the allocation.
  bool InUse(uint64_t buffer_id) const;

 private:
  struct Entry {
    std::string region;
    uint64_t base = 0;
    uint64_t last_use = 0;
    int calls = 0;
  };
  void Release(const std::vector<uint64_t>& buffer_ids);

  mutable std::mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_;
  uint64_t clock_ = 0;
};

// mhc_client._native.CudaRegionTable, the Python face of the table.
PyObject* NewCudaRegionTableType();
// The table of a CudaRegionTable object; nullptr (TypeError set) otherwise.
CudaRegionTable* CudaRegionTableOf(PyObject* object);

}  // namespace mhc::client::python

#endif  // MHC_CLIENT_PYTHON_NATIVE_CUDA_REGIONS_H_
