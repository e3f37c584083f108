// Sessions and the shared-memory regions they own (see shm.proto).
//
// A session exists while its OpenSession stream is open. Regions live in
// their session's namespace; a region is a mapping (POSIX shm: mmap of the
// registered range only, with the descriptor kept for size re-checks; CUDA
// IPC: the opened device pointer) held by a shared_ptr, so a request that
// holds it (in use) keeps it mapped even after the session ends.
// Unregistering a region in use is refused instead of waiting: a request can
// run for long, and the client that owns both the request and the region can
// simply retry.
//
// On a daemon serving CUDA devices the mapping of a system region is also
// page-locked ("pinned" in CUDA's terms; HostMemoryPinner) for as long as it
// is mapped, so that copies between it and a GPU run asynchronously by DMA.
// That is an optimisation: when it fails the region is registered anyway
// and copied through pageable memory.
//
// Every failure path releases what it acquired (descriptor, mapping, page
// lock, watch slot, IPC handle) through the Region destructor, and messages
// name regions, never keys.
#ifndef MHC_SERVER_SHM_SHM_REGISTRY_H_
#define MHC_SERVER_SHM_SHM_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mhc/backend.h"
#include "mhc/v1/shm.pb.h"
#include "mhc/v1/tensor.pb.h"
#include "server/peer_credentials.h"

namespace mhc::server {

struct ShmOptions {
  bool enabled = false;    // --allow_shm
  bool allow_tcp = false;  // --shm_allow_tcp
  std::string key_prefix = "mhcd_";
  int max_regions_per_session = 64;
  uint64_t max_bytes_per_session = uint64_t{64} << 30;
  int max_sessions = 64;  // each open session holds a server thread
  // Page-lock system regions when a CUDA device is served (--shm_pin_host;
  // MhcServer gives the registry a pinner then).
  bool pin_host = true;
  // Refuse system regions of callers whose user is unknown (not on a unix
  // socket); set when authentication is on.
  bool require_peer_credentials = false;
  // How long a call ring's thread polls for the next request before it
  // sleeps (--shm_call_ring_spin_us).
  absl::Duration call_ring_spin = absl::Microseconds(50);
};

// Opens other processes' CUDA allocations. Only a daemon serving a CUDA
// device has one; without it RegisterCudaSharedMemory is refused.
class DeviceMemoryOpener {
 public:
  virtual ~DeviceMemoryOpener() = default;
  virtual int DeviceCount() const = 0;
  struct Opened {
    void* ptr = nullptr;
    uint64_t byte_size = 0;  // as requested, or the whole allocation for 0
  };
  // Opens a 64-byte cudaIpcMemHandle_t on `device`; fails unless the
  // allocation holds at least `byte_size` bytes (0: all of it).
  virtual absl::StatusOr<Opened> Open(absl::string_view handle, int device,
                                      uint64_t byte_size) = 0;
  // Closes once the device has finished the work queued so far, which may
  // still read the memory (requests are answered before their work ends).
  virtual void Close(int device, void* ptr) = 0;
  // Distinct allocations mapped now, and their bytes.
  virtual std::pair<int, uint64_t> MappedTotals() const = 0;

  // Interprocess events (stream order): opens a client's 64-byte
  // cudaIpcEventHandle_t on `device`, or makes an event of the daemon's own
  // and returns it with its handle.
  virtual absl::StatusOr<DeviceEvent> OpenEvent(absl::string_view handle,
                                                int device) = 0;
  struct ExportedEvent {
    DeviceEvent event = nullptr;
    std::string handle;
  };
  virtual absl::StatusOr<ExportedEvent> CreateEvent(int device) = 0;
  virtual void DestroyEvent(int device, DeviceEvent event) = 0;
};

// One session's events on one device (RegisterCudaEvents): the client's,
// which requests wait for, and the daemon's, which requests record.
class EventPool {
 public:
  EventPool(DeviceMemoryOpener* opener, int device)
      : opener_(opener), device_(device) {}
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

 private:
  friend class ShmRegistry;
  friend class RegionScope;
  DeviceMemoryOpener* const opener_;
  const int device_;
  std::vector<DeviceEvent> client_;
  std::vector<DeviceEvent> daemon_;
};

// How a deferred ring request (call_ring.h) tells the client's stream that
// its device work is done: a word the device stream writes after the work.
class DeviceCompletion {
 public:
  virtual ~DeviceCompletion() = default;
  // The device address to write value() to after the work queued on
  // `device`; null when the work must finish before the answer instead.
  virtual void* Word(int device) = 0;
  virtual uint32_t value() const = 0;
  // The write is queued on `device`'s stream.
  virtual void Queued(int device) = 0;
};

// The events one request waits for and records (null: none), and the word
// its work's last step writes (null: none).
struct StreamOrder {
  DeviceEvent wait = nullptr;
  DeviceEvent signal = nullptr;
  void* done_word = nullptr;
  uint32_t done_value = 0;
};

// Page-locks host memory for every CUDA device of the process, so that a
// device copies from and to it by DMA: asynchronously, at full bandwidth,
// and without the driver's pageable staging buffers. Only a daemon serving a
// CUDA device has one; host backends read mappings in place.
class HostMemoryPinner {
 public:
  virtual ~HostMemoryPinner() = default;
  // Page-locks [base, base + bytes). `read_only`: the mapping is not
  // writable, so the device may only read it.
  virtual absl::Status Pin(void* base, size_t bytes, bool read_only) = 0;
  // Undoes Pin(base, ...); called before the memory is unmapped.
  virtual void Unpin(void* base) = 0;
  // The address devices use for `host`, inside pinned memory.
  virtual absl::StatusOr<void*> DeviceAddress(void* /*host*/) {
    return absl::UnimplementedError("devices cannot address host memory");
  }
};

// What became of page-locking a new system region.
enum class HostPinning {
  kNotNeeded,  // no pinner: no CUDA device served, or --shm_pin_host=false
  kPinned,
  kFailed,  // e.g. locked-memory limits; its copies use pageable memory
};

// One registered region. Immutable after registration except for the use
// count.
class Region {
 public:
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& name() const { return name_; }
  v1::SharedMemoryKind kind() const { return kind_; }
  uint64_t offset() const { return offset_; }
  uint64_t byte_size() const { return byte_size_; }
  int device_id() const { return device_id_; }
  int in_use() const { return uses_.load(); }
  // A fault was absorbed in the mapping: the object was truncated under it.
  bool Broken() const;
  // SYSTEM: the object is now smaller than the registered range. Device
  // copies into a page-locked mapping never fault, so this is how a
  // truncation during a request is seen there.
  bool Shrunk() const;
  // SYSTEM: the mapping is page-locked for device copies.
  bool pinned() const { return pinner_ != nullptr; }
  // SYSTEM, pinned: the address devices use for `host`, a byte of the
  // mapping (FAILED_PRECONDITION when the region is not pinned).
  absl::StatusOr<void*> DeviceAddress(void* host) const;
  // The first registered byte in this process (host or device memory).
  char* data() const { return data_; }
  // SYSTEM: the object's open descriptor (-1 for CUDA).
  int descriptor() const { return fd_; }
  // Gives back the hold ShmRegistry::Find took.
  void Release() { uses_.fetch_sub(1); }
  // Host memory the page lock holds (the whole mapping), 0 when unpinned.
  uint64_t pinned_bytes() const { return pinned() ? map_bytes_ : 0; }

 private:
  friend class ShmRegistry;
  friend class RegionScope;
  Region() = default;

  std::string name_;
  v1::SharedMemoryKind kind_ = v1::SHARED_MEMORY_KIND_UNSPECIFIED;
  uint64_t offset_ = 0;
  uint64_t byte_size_ = 0;
  int device_id_ = -1;
  char* data_ = nullptr;  // first registered byte (host or device)
  // SYSTEM: the descriptor, the page-aligned mapping and its identity.
  int fd_ = -1;
  void* map_base_ = nullptr;
  size_t map_bytes_ = 0;
  int watch_slot_ = -1;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  // Set once the mapping is page-locked; unpins it before it is unmapped.
  HostMemoryPinner* pinner_ = nullptr;
  // CUDA.
  DeviceMemoryOpener* opener_ = nullptr;
  std::atomic<int> uses_{0};
};

// A held byte range of a region, valid while its RegionScope lives.
struct RegionSpan {
  void* data = nullptr;
  uint64_t bytes = 0;
  bool device = false;  // CUDA device memory
  int device_id = -1;
  bool pinned = false;  // page-locked host memory (see HostMemoryPinner)
};

class ShmRegistry;

// How a request names a session: the id it sent (metadata "mhc-session-id",
// empty when absent) and who sent it (Authorizer::Identify). A session
// answers only to the caller that opened it, so an id that leaked (logs,
// another process of the node) is of no use to anyone else.
struct SessionRef {
  std::string id;
  std::string caller;
};

// The regions one request uses: resolves the caller's session once, pins
// every region it hands out until destroyed, and refuses output ranges that
// overlap any other tensor of the request in the same memory.
class RegionScope {
 public:
  // `session`: the request's session and caller; `local`: the request came
  // over a unix socket; `wait_event` and `signal_event`: its
  // "mhc-wait-event" and "mhc-signal-event" (empty when absent);
  // `completion`: a deferred ring request's (null for others).
  RegionScope(ShmRegistry* registry, SessionRef session, bool local,
              std::string wait_event = "", std::string signal_event = "",
              DeviceCompletion* completion = nullptr);
  ~RegionScope();
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;

  // `bytes`: the tensor's size, which ref.byte_size must equal.
  absl::StatusOr<RegionSpan> Acquire(const v1::SharedMemoryRef& ref,
                                     uint64_t bytes, bool output,
                                     absl::string_view field);
  // The events the request names, on CUDA device `device` (-1: the
  // request's layers are not on a CUDA device), and its completion word.
  // The pool stays alive while this scope does.
  absl::StatusOr<StreamOrder> Events(int device);
  // The completion word of Events(device) is queued on its stream.
  void CompletionQueued(int device);
  // After the request ran: FAILED_PRECONDITION when a region's object was
  // truncated while the request used it (its results are not valid), seen
  // by a fault or by the object's size.
  absl::Status CheckIntact() const;

 private:
  struct Use {
    std::shared_ptr<Region> region;
    uint64_t object_a, object_b, start, end;
    bool output;
    std::string field;
  };
  ShmRegistry* const registry_;
  const SessionRef session_;
  const bool local_;
  const std::string wait_event_;
  const std::string signal_event_;
  DeviceCompletion* const completion_;
  std::vector<Use> uses_;
  std::shared_ptr<EventPool> events_;
};

class ShmRegistry {
 public:
  // `cuda` opens CUDA IPC regions and `pinner` page-locks system regions;
  // either may be null (a daemon without CUDA devices has neither).
  ShmRegistry(ShmOptions options, std::unique_ptr<DeviceMemoryOpener> cuda,
              std::unique_ptr<HostMemoryPinner> pinner = nullptr);
  ~ShmRegistry();

  const ShmOptions& options() const { return options_; }

  // Shared memory enabled, and the transport allowed.
  absl::Status CheckAccess(bool local) const;

  // A new session of `caller` (Authorizer::Identify), the only caller it
  // answers to; `cancel` ends its stream (used when draining). Returns its
  // id.
  absl::StatusOr<std::string> OpenSession(std::string caller,
                                          std::function<void()> cancel);
  // Ends a session: its regions are unregistered (mappings in use by
  // requests live until those finish).
  void CloseSession(const std::string& id);
  // Ends every session's stream and refuses new sessions (drain, shutdown).
  void CancelAllSessions();

  // Registration never fails for want of a page lock: kFailed says that
  // the region was registered unpinned. `peer`: the caller's user when
  // known; the object is mapped only if that user could open it for
  // reading and writing itself (PERMISSION_DENIED otherwise), so the
  // daemon's own rights never stand in for the caller's.
  absl::StatusOr<HostPinning> RegisterSystem(
      const SessionRef& session, const v1::RegisterSystemSharedMemoryRequest& r,
      const std::optional<PeerCredentials>& peer);
  // Returns the bytes registered (the whole allocation for byte_size 0).
  absl::StatusOr<uint64_t> RegisterCuda(
      const SessionRef& session, const v1::RegisterCudaSharedMemoryRequest& r);
  // One region, or all of the session's when `name` is empty.
  absl::StatusOr<std::vector<std::string>> Unregister(const SessionRef& session,
                                                      const std::string& name);
  absl::Status Status(const SessionRef& session, const std::string& name,
                      v1::SharedMemoryStatusResponse* response);
  // Opens the client's events and makes as many of the daemon's (see
  // RegisterCudaEventsRequest).
  absl::Status RegisterEvents(const SessionRef& session,
                              const v1::RegisterCudaEventsRequest& request,
                              v1::RegisterCudaEventsResponse* response);
  // The session's event pool on `device`.
  absl::StatusOr<std::shared_ptr<EventPool>> FindEvents(
      const SessionRef& session, int device);
  // Client allocations mapped through CUDA IPC, and their bytes.
  std::pair<int, uint64_t> MappedTotals() const;

  // The caller's region `name`, held for the caller (see in_use).
  absl::StatusOr<std::shared_ptr<Region>> Find(const SessionRef& session,
                                               const std::string& name,
                                               absl::string_view field);

  int session_count() const;
  bool HasSession(const std::string& id) const;
  // Regions and registered bytes of `kind` across all sessions.
  std::pair<int, uint64_t> Totals(v1::SharedMemoryKind kind) const;
  // Registered regions that are page-locked, and the host bytes locked.
  std::pair<int, uint64_t> PinnedTotals() const;

 private:
  struct Session {
    std::string owner;  // the caller that opened it
    std::function<void()> cancel;
    std::map<std::string, std::shared_ptr<Region>> regions;
    uint64_t bytes = 0;
    std::map<int, std::shared_ptr<EventPool>> events;  // by device
  };

  // NOT_FOUND for an id no open session has, PERMISSION_DENIED when the
  // session is another caller's.
  absl::StatusOr<Session*> FindSession(const SessionRef& ref)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Name, quota and duplicate checks before anything is opened.
  absl::Status CheckNewRegion(const SessionRef& session,
                              const std::string& name, uint64_t byte_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Add(const SessionRef& session, std::shared_ptr<Region> region);
  // Page-locks a new region's mapping when this daemon has a pinner.
  HostPinning Pin(Region& region);

  const ShmOptions options_;
  const std::unique_ptr<DeviceMemoryOpener> cuda_;
  const std::unique_ptr<HostMemoryPinner> pinner_;
  // The first failure to page-lock is logged; later ones are counted.
  std::atomic<bool> pin_failure_logged_{false};
  mutable absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

// The metadata key that carries the session id.
inline constexpr char kSessionMetadataKey[] = "mhc-session-id";
// The metadata keys of stream-ordered requests: indices into the session's
// events on the request's device (see shm.proto).
inline constexpr char kWaitEventMetadataKey[] = "mhc-wait-event";
inline constexpr char kSignalEventMetadataKey[] = "mhc-signal-event";

}  // namespace mhc::server

#endif  // MHC_SERVER_SHM_SHM_REGISTRY_H_
