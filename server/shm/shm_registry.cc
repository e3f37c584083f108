#include "server/shm/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "mhc/status.h"
#include "server/log.h"
#include "server/shm/shm_guard.h"

namespace mhc::server {
namespace {

constexpr size_t kMaxNameBytes = 128;
constexpr size_t kMaxKeyBytes = 255;  // NAME_MAX of /dev/shm
constexpr size_t kCudaHandleBytes = 64;

bool SafeChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
}

absl::Status CheckName(absl::string_view name) {
  bool ok = !name.empty() && name.size() <= kMaxNameBytes;
  for (char c : name) ok = ok && SafeChar(c);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("name: expected 1..", kMaxNameBytes,
                   " characters of [A-Za-z0-9_.-], got '",
                   absl::CEscape(name.substr(0, kMaxNameBytes)), "'"));
}

// Keys are never echoed: they name objects of the node and may be secrets
// shared between the client's processes.
absl::Status CheckKey(absl::string_view key, absl::string_view prefix) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: expected 1..", kMaxKeyBytes, " bytes"));
  }
  if (key.front() == '/') {
    return absl::InvalidArgumentError(
        "key: give the object name without a leading '/'");
  }
  for (char c : key) {
    if (!SafeChar(c)) {
      return absl::InvalidArgumentError(
          "key: only [A-Za-z0-9_.-] are allowed (no '/')");
    }
  }
  if (absl::StrContains(key, "..")) {
    return absl::InvalidArgumentError("key: must not contain '..'");
  }
  if (!absl::StartsWith(key, prefix) || key.size() == prefix.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: must be the prefix '", prefix,
        "' (--shm_key_prefix) followed by at least one character"));
  }
  return absl::OkStatus();
}

absl::Status CheckRange(uint64_t offset, uint64_t byte_size) {
  if (byte_size == 0) {
    return absl::InvalidArgumentError("byte_size: expected >= 1");
  }
  if (offset > UINT64_MAX - byte_size) {
    return absl::InvalidArgumentError("offset + byte_size: overflows");
  }
  if (offset + byte_size > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError(
        "offset + byte_size: larger than any object can be");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NewSessionId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::InternalError(
          absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status NoSession() {
  return absl::FailedPreconditionError(absl::StrCat(
      "no session: open one with OpenSession and send its id as metadata '",
      kSessionMetadataKey, "'"));
}

}  // namespace

Region::~Region() {
  // Before munmap: a page lock outliving its mapping would leak the pages.
  if (pinner_ != nullptr) pinner_->Unpin(map_base_);
  shm_guard::Unwatch(watch_slot_);
  if (map_base_ != nullptr) munmap(map_base_, map_bytes_);
  if (fd_ >= 0) close(fd_);
  if (opener_ != nullptr && data_ != nullptr) opener_->Close(device_id_, data_);
}

EventPool::~EventPool() {
  for (DeviceEvent event : client_) opener_->DestroyEvent(device_, event);
  for (DeviceEvent event : daemon_) opener_->DestroyEvent(device_, event);
}

bool Region::Broken() const {
  return watch_slot_ >= 0 && shm_guard::Faulted(watch_slot_);
}

absl::StatusOr<void*> Region::DeviceAddress(void* host) const {
  if (pinner_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("region '", name_, "' is not page-locked"));
  }
  return pinner_->DeviceAddress(host);
}

bool Region::Shrunk() const {
  if (fd_ < 0) return false;
  struct stat st = {};
  return fstat(fd_, &st) != 0 ||
         static_cast<uint64_t>(st.st_size) < offset_ + byte_size_;
}

ShmRegistry::ShmRegistry(ShmOptions options,
                         std::unique_ptr<DeviceMemoryOpener> cuda,
                         std::unique_ptr<HostMemoryPinner> pinner)
    : options_(std::move(options)),
      cuda_(std::move(cuda)),
      pinner_(std::move(pinner)) {
  if (options_.enabled) shm_guard::Install();
}

ShmRegistry::~ShmRegistry() = default;

absl::Status ShmRegistry::CheckAccess(bool local) const {
  if (!options_.enabled) {
    return absl::FailedPreconditionError(
        "shared memory is not enabled (start mhcd with --allow_shm)");
  }
  if (!local && !options_.allow_tcp) {
    return absl::PermissionDeniedError(
        "shared memory is accepted only over a unix socket (start mhcd with "
        "--shm_allow_tcp to allow other transports)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ShmRegistry::OpenSession(
    std::string caller, std::function<void()> cancel) {
  MHC_ASSIGN_OR_RETURN(std::string id, NewSessionId());
  absl::MutexLock lock(&mu_);
  if (closing_) {
    return absl::UnavailableError("OpenSession: the daemon is shutting down");
  }
  if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("OpenSession: ", options_.max_sessions,
                     " sessions are open, the most allowed"));
  }
  Session& session = sessions_[id];
  session.owner = std::move(caller);
  session.cancel = std::move(cancel);
  return id;
}

void ShmRegistry::CloseSession(const std::string& id) {
  Session ended;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    ended = std::move(it->second);
    sessions_.erase(it);
  }
  // Regions are released here, outside the lock; held ones on their last
  // request's exit.
}

void ShmRegistry::CancelAllSessions() {
  // Under the lock: a session still listed has a live stream (its handler
  // closes the session before returning), so cancel never touches a call
  // that is gone. Cancelling only wakes the handler's Read.
  absl::MutexLock lock(&mu_);
  closing_ = true;
  for (auto& [id, session] : sessions_) {
    if (session.cancel) session.cancel();
  }
}

bool ShmRegistry::HasSession(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return sessions_.count(id) > 0;
}

int ShmRegistry::session_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

std::pair<int, uint64_t> ShmRegistry::Totals(v1::SharedMemoryKind kind) const {
  absl::MutexLock lock(&mu_);
  std::pair<int, uint64_t> totals{0, 0};
  for (const auto& [id, session] : sessions_) {
    for (const auto& [name, region] : session.regions) {
      if (region->kind() != kind) continue;
      ++totals.first;
      totals.second += region->byte_size();
    }
  }
  return totals;
}

std::pair<int, uint64_t> ShmRegistry::PinnedTotals() const {
  absl::MutexLock lock(&mu_);
  std::pair<int, uint64_t> totals{0, 0};
  for (const auto& [id, session] : sessions_) {
    for (const auto& [name, region] : session.regions) {
      if (!region->pinned()) continue;
      ++totals.first;
      totals.second += region->pinned_bytes();
    }
  }
  return totals;
}

absl::StatusOr<ShmRegistry::Session*> ShmRegistry::FindSession(
    const SessionRef& ref) {
  if (ref.id.empty()) return NoSession();
  auto it = sessions_.find(ref.id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat(kSessionMetadataKey,
                     ": no open session has this id (its stream ended, or it "
                     "was never opened)"));
  }
  // Ids are random and never reused, so a session found once stays the
  // same caller's for as long as it lives.
  if (it->second.owner != ref.caller) {
    return absl::PermissionDeniedError(absl::StrCat(
        kSessionMetadataKey,
        ": the session belongs to another caller; a session answers only to "
        "the unix user (or, with authentication on, the token) that opened "
        "it. Open one of your own with OpenSession"));
  }
  return &it->second;
}

absl::Status ShmRegistry::CheckNewRegion(const SessionRef& ref,
                                         const std::string& name,
                                         uint64_t byte_size) {
  MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
  if (session->regions.count(name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "name: region '", name, "' is already registered in this session"));
  }
  if (static_cast<int>(session->regions.size()) >=
      options_.max_regions_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "name: the session has ", session->regions.size(),
        " regions, the most allowed (--shm_max_regions_per_session)"));
  }
  if (byte_size > options_.max_bytes_per_session - session->bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "byte_size: ", byte_size, " more bytes would exceed the session's ",
        options_.max_bytes_per_session,
        " bytes (--shm_max_bytes_per_session); it holds ", session->bytes));
  }
  return absl::OkStatus();
}

absl::Status ShmRegistry::Add(const SessionRef& ref,
                              std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  // Checked again: the session may have ended, or raced another
  // registration, while the object was being opened.
  MHC_RETURN_IF_ERROR(CheckNewRegion(ref, region->name_, region->byte_size_));
  Session& session = sessions_[ref.id];
  session.bytes += region->byte_size_;
  session.regions.emplace(region->name_, std::move(region));
  return absl::OkStatus();
}

HostPinning ShmRegistry::Pin(Region& region) {
  if (pinner_ == nullptr) return HostPinning::kNotNeeded;
  // The daemon maps every region read-write: outputs may land in any.
  absl::Status pinned =
      pinner_->Pin(region.map_base_, region.map_bytes_, /*read_only=*/false);
  if (pinned.ok()) {
    region.pinner_ = pinner_.get();
    return HostPinning::kPinned;
  }
  if (!pin_failure_logged_.exchange(true)) {
    Log(LogLevel::kWarning,
        absl::StrCat("cannot page-lock shared-memory region '", region.name_,
                     "' (", pinned.message(),
                     "); it is copied to and from the GPU through pageable "
                     "memory, which is slower. Check the locked-memory limit "
                     "(ulimit -l) and free host memory, or start mhcd with "
                     "--shm_pin_host=false. Only this failure is logged; all "
                     "are counted in mhcd_shm_pin_failures_total."));
  }
  return HostPinning::kFailed;
}

absl::StatusOr<HostPinning> ShmRegistry::RegisterSystem(
    const SessionRef& session, const v1::RegisterSystemSharedMemoryRequest& r,
    const std::optional<PeerCredentials>& peer) {
  MHC_RETURN_IF_ERROR(CheckName(r.name()));
  if (!peer.has_value() && options_.require_peer_credentials) {
    return absl::PermissionDeniedError(
        "system shared memory needs a caller on a unix socket when "
        "authentication is on (its user decides which objects it may map)");
  }
  MHC_RETURN_IF_ERROR(CheckKey(r.key(), options_.key_prefix));
  MHC_RETURN_IF_ERROR(CheckRange(r.offset(), r.byte_size()));
  {
    absl::MutexLock lock(&mu_);
    MHC_RETURN_IF_ERROR(CheckNewRegion(session, r.name(), r.byte_size()));
  }
  // From here on the Region's destructor releases whatever was acquired.
  std::shared_ptr<Region> region(new Region());
  region->name_ = r.name();
  region->kind_ = v1::SHARED_MEMORY_KIND_SYSTEM;
  region->offset_ = r.offset();
  region->byte_size_ = r.byte_size();
  const std::string path = absl::StrCat("/", r.key());
  region->fd_ = shm_open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (region->fd_ < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::NotFoundError("key: no shared-memory object has this key");
    }
    if (error == EACCES || error == EPERM) {
      return absl::PermissionDeniedError(
          "key: the daemon may not open this object for reading and writing");
    }
    return absl::InvalidArgumentError(
        absl::StrCat("key: cannot open the object: ", std::strerror(error)));
  }
  struct stat st = {};
  if (fstat(region->fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        "key: the object is not a shared-memory file");
  }
  // Checked on the opened object, so a rename or a new object under the
  // key cannot swap what is mapped after the check.
  if (peer.has_value() && !MayReadWrite(*peer, st)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "key: the caller (uid ", peer->uid,
        ") may not open this object for reading and writing (owner uid ",
        st.st_uid, ", group ", st.st_gid, ", mode ",
        absl::StrFormat("%03o", st.st_mode & 0777), ")"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (r.offset() > size || r.byte_size() > size - r.offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset + byte_size: ", r.offset(), " + ", r.byte_size(),
                     " is past the end of the object (", size, " bytes)"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = r.offset() / page * page;
  const uint64_t lead = r.offset() - map_offset;
  region->map_bytes_ = static_cast<size_t>(lead + r.byte_size());
  void* base = mmap(nullptr, region->map_bytes_, PROT_READ | PROT_WRITE,
                    MAP_SHARED, region->fd_, static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int error = errno;
    if (error == ENOMEM) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "byte_size: cannot map ", r.byte_size(), " bytes into the daemon"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("key: cannot map the object: ", std::strerror(error)));
  }
  region->map_base_ = base;
  region->data_ = static_cast<char*>(base) + lead;
  region->watch_slot_ = shm_guard::Watch(base, region->map_bytes_);
  if (region->watch_slot_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the daemon holds ", shm_guard::kMaxWatched,
                     " shared-memory regions, the most it can"));
  }
  region->dev_ = static_cast<uint64_t>(st.st_dev);
  region->ino_ = static_cast<uint64_t>(st.st_ino);
  // Outside the lock: locking a large mapping faults in every page.
  const HostPinning pinning = Pin(*region);
  MHC_RETURN_IF_ERROR(Add(session, std::move(region)));
  return pinning;
}

absl::StatusOr<uint64_t> ShmRegistry::RegisterCuda(
    const SessionRef& session, const v1::RegisterCudaSharedMemoryRequest& r) {
  MHC_RETURN_IF_ERROR(CheckName(r.name()));
  if (r.raw_handle().size() != kCudaHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_handle: expected exactly ", kCudaHandleBytes,
        " bytes (a cudaIpcMemHandle_t), got ", r.raw_handle().size()));
  }
  if (r.byte_size() != 0) MHC_RETURN_IF_ERROR(CheckRange(0, r.byte_size()));
  if (r.device_id() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id: expected >= 0, got ", r.device_id()));
  }
  if (cuda_ == nullptr) {
    return absl::FailedPreconditionError(
        "RegisterCudaSharedMemory: this daemon serves no CUDA device; use "
        "RegisterSystemSharedMemory for host tensors");
  }
  if (r.device_id() >= cuda_->DeviceCount()) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: expected 0..",
                                                   cuda_->DeviceCount() - 1,
                                                   ", got ", r.device_id()));
  }
  {
    absl::MutexLock lock(&mu_);
    MHC_RETURN_IF_ERROR(CheckNewRegion(session, r.name(), r.byte_size()));
  }
  MHC_ASSIGN_OR_RETURN(
      DeviceMemoryOpener::Opened opened,
      cuda_->Open(r.raw_handle(), r.device_id(), r.byte_size()));
  std::shared_ptr<Region> region(new Region());
  region->opener_ = cuda_.get();
  region->data_ = static_cast<char*>(opened.ptr);
  region->device_id_ = r.device_id();
  region->name_ = r.name();
  region->kind_ = v1::SHARED_MEMORY_KIND_CUDA;
  region->byte_size_ = opened.byte_size;
  // The quota is checked again with the size actually opened.
  MHC_RETURN_IF_ERROR(Add(session, std::move(region)));
  return opened.byte_size;
}

absl::StatusOr<std::vector<std::string>> ShmRegistry::Unregister(
    const SessionRef& ref, const std::string& name) {
  std::vector<std::shared_ptr<Region>> released;
  std::vector<std::string> names;
  absl::MutexLock lock(&mu_);
  MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
  if (name.empty()) {
    std::vector<std::string> busy;
    for (const auto& [region_name, region] : session->regions) {
      if (region->in_use() > 0) busy.push_back(region_name);
    }
    if (!busy.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "regions in use by running requests: ", absl::StrJoin(busy, ", "),
          "; nothing was unregistered, retry after they finish"));
    }
    for (auto& [region_name, region] : session->regions) {
      names.push_back(region_name);
      released.push_back(std::move(region));
    }
    session->regions.clear();
    session->bytes = 0;
    return names;
  }
  MHC_RETURN_IF_ERROR(CheckName(name));
  auto it = session->regions.find(name);
  if (it == session->regions.end()) {
    for (const auto& [id, other] : sessions_) {
      if (other.regions.count(name) > 0) {
        return absl::PermissionDeniedError(absl::StrCat(
            "name: region '", name, "' belongs to another session"));
      }
    }
    return absl::NotFoundError(
        absl::StrCat("name: no region '", name, "' in this session"));
  }
  if (it->second->in_use() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "name: region '", name, "' is in use by ", it->second->in_use(),
        " running request(s); retry after they finish"));
  }
  session->bytes -= it->second->byte_size();
  released.push_back(std::move(it->second));
  session->regions.erase(it);
  names.push_back(name);
  return names;
}

absl::Status ShmRegistry::Status(const SessionRef& ref, const std::string& name,
                                 v1::SharedMemoryStatusResponse* response) {
  absl::MutexLock lock(&mu_);
  MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
  response->set_bytes(session->bytes);
  response->set_max_regions(options_.max_regions_per_session);
  response->set_max_bytes(options_.max_bytes_per_session);
  if (!name.empty() && session->regions.count(name) == 0) {
    return absl::NotFoundError(absl::StrCat(
        "name: no region '", absl::CEscape(name), "' in this session"));
  }
  for (const auto& [region_name, region] : session->regions) {
    if (!name.empty() && region_name != name) continue;
    v1::SharedMemoryRegionStatus* status = response->add_regions();
    status->set_name(region_name);
    status->set_kind(region->kind());
    status->set_offset(region->offset());
    status->set_byte_size(region->byte_size());
    status->set_device_id(region->device_id());
    status->set_in_use(region->in_use());
    status->set_pinned(region->pinned());
  }
  return absl::OkStatus();
}

absl::Status ShmRegistry::RegisterEvents(
    const SessionRef& ref, const v1::RegisterCudaEventsRequest& r,
    v1::RegisterCudaEventsResponse* response) {
  constexpr int kMaxEvents = 256;
  constexpr size_t kEventHandleBytes = 64;
  if (r.raw_handles_size() < 1 || r.raw_handles_size() > kMaxEvents) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_handles: expected 1..", kMaxEvents,
                     " event handles, got ", r.raw_handles_size()));
  }
  for (int i = 0; i < r.raw_handles_size(); ++i) {
    if (r.raw_handles(i).size() != kEventHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "raw_handles[", i, "]: expected ", kEventHandleBytes,
          " bytes (a cudaIpcEventHandle_t), got ", r.raw_handles(i).size()));
    }
  }
  if (cuda_ == nullptr) {
    return absl::FailedPreconditionError(
        "RegisterCudaEvents: this daemon serves no CUDA device; its requests "
        "finish before they are answered");
  }
  if (r.device_id() < 0 || r.device_id() >= cuda_->DeviceCount()) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: expected 0..",
                                                   cuda_->DeviceCount() - 1,
                                                   ", got ", r.device_id()));
  }
  auto check_new = [&]() -> absl::Status {
    MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
    if (session->events.count(r.device_id()) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("device_id: this session already registered its events "
                       "on device ",
                       r.device_id()));
    }
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    MHC_RETURN_IF_ERROR(check_new());
  }
  // Outside the lock: opening talks to the driver. The pool destroys what
  // was made if anything below fails.
  auto pool = std::make_shared<EventPool>(cuda_.get(), r.device_id());
  for (int i = 0; i < r.raw_handles_size(); ++i) {
    absl::StatusOr<DeviceEvent> opened =
        cuda_->OpenEvent(r.raw_handles(i), r.device_id());
    if (!opened.ok()) {
      return absl::Status(
          opened.status().code(),
          absl::StrCat("raw_handles[", i, "]: ", opened.status().message()));
    }
    pool->client_.push_back(*opened);
    MHC_ASSIGN_OR_RETURN(DeviceMemoryOpener::ExportedEvent own,
                         cuda_->CreateEvent(r.device_id()));
    pool->daemon_.push_back(own.event);
    response->add_raw_handles(own.handle);
  }
  absl::MutexLock lock(&mu_);
  MHC_RETURN_IF_ERROR(check_new());
  sessions_[ref.id].events[r.device_id()] = std::move(pool);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<EventPool>> ShmRegistry::FindEvents(
    const SessionRef& ref, int device) {
  absl::MutexLock lock(&mu_);
  MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
  auto it = session->events.find(device);
  if (it == session->events.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the session has no events on device ", device,
        " (register them with RegisterCudaEvents before naming them)"));
  }
  return it->second;
}

std::pair<int, uint64_t> ShmRegistry::MappedTotals() const {
  if (cuda_ == nullptr) return {0, 0};
  return cuda_->MappedTotals();
}

absl::StatusOr<std::shared_ptr<Region>> ShmRegistry::Find(
    const SessionRef& ref, const std::string& name, absl::string_view field) {
  absl::MutexLock lock(&mu_);
  MHC_ASSIGN_OR_RETURN(Session * session, FindSession(ref));
  auto it = session->regions.find(name);
  if (it == session->regions.end()) {
    for (const auto& [id, other] : sessions_) {
      if (other.regions.count(name) > 0) {
        return absl::PermissionDeniedError(absl::StrCat(
            field, ".region: region '", name, "' belongs to another session"));
      }
    }
    return absl::NotFoundError(absl::StrCat(field, ".region: no region '",
                                            absl::CEscape(name),
                                            "' in this session"));
  }
  // Held under the lock, so Unregister's in-use check cannot miss it.
  it->second->uses_.fetch_add(1);
  return it->second;
}

RegionScope::RegionScope(ShmRegistry* registry, SessionRef session, bool local,
                         std::string wait_event, std::string signal_event,
                         DeviceCompletion* completion)
    : registry_(registry),
      session_(std::move(session)),
      local_(local),
      wait_event_(std::move(wait_event)),
      signal_event_(std::move(signal_event)),
      completion_(completion) {}

void RegionScope::CompletionQueued(int device) {
  if (completion_ != nullptr) completion_->Queued(device);
}

absl::StatusOr<StreamOrder> RegionScope::Events(int device) {
  StreamOrder order;
  if (completion_ != nullptr && device >= 0) {
    order.done_word = completion_->Word(device);
    order.done_value = completion_->value();
  }
  if (wait_event_.empty() && signal_event_.empty()) return order;
  if (device < 0) {
    return absl::FailedPreconditionError(
        "mhc-wait-event / mhc-signal-event: the request's layers are not on "
        "a CUDA device, and its ops finish before it is answered");
  }
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        "mhc-wait-event / mhc-signal-event: shared memory is not enabled");
  }
  MHC_RETURN_IF_ERROR(registry_->CheckAccess(local_));
  MHC_ASSIGN_OR_RETURN(events_, registry_->FindEvents(session_, device));
  auto pick = [](const std::string& text, const std::vector<DeviceEvent>& pool,
                 absl::string_view key) -> absl::StatusOr<DeviceEvent> {
    if (text.empty()) return DeviceEvent{nullptr};
    int index = -1;
    if (!absl::SimpleAtoi(text, &index) || index < 0 ||
        index >= static_cast<int>(pool.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": expected an event index 0..", pool.size() - 1,
                       ", got '", absl::CEscape(text.substr(0, 32)), "'"));
    }
    return pool[index];
  };
  MHC_ASSIGN_OR_RETURN(order.wait,
                       pick(wait_event_, events_->client_, "mhc-wait-event"));
  MHC_ASSIGN_OR_RETURN(
      order.signal, pick(signal_event_, events_->daemon_, "mhc-signal-event"));
  return order;
}

RegionScope::~RegionScope() {
  for (Use& use : uses_) use.region->uses_.fetch_sub(1);
}

absl::StatusOr<RegionSpan> RegionScope::Acquire(const v1::SharedMemoryRef& ref,
                                                uint64_t bytes, bool output,
                                                absl::string_view field) {
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shared memory is not enabled"));
  }
  absl::Status access = registry_->CheckAccess(local_);
  if (!access.ok()) {
    return absl::Status(access.code(),
                        absl::StrCat(field, ": ", access.message()));
  }
  if (ref.byte_size() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".byte_size: expected ", bytes,
                     " (the tensor's size), got ", ref.byte_size()));
  }
  MHC_ASSIGN_OR_RETURN(std::shared_ptr<Region> region,
                       registry_->Find(session_, ref.region(), field));
  uses_.push_back(Use{region, 0, 0, 0, 0, output, std::string(field)});
  Use& use = uses_.back();
  if (ref.offset() > region->byte_size() ||
      bytes > region->byte_size() - ref.offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": offset ", ref.offset(), " + byte_size ", bytes,
                     " is outside region '", region->name(), "' (",
                     region->byte_size(), " bytes)"));
  }
  if (region->Broken()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": region '", region->name(),
        "' lost its memory (its object was truncated while in use); "
        "unregister and register it again"));
  }
  const bool device = region->kind() == v1::SHARED_MEMORY_KIND_CUDA;
  if (!device) {
    if (region->Shrunk()) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": the object of region '", region->name(),
                       "' is now smaller than its registered range (it was "
                       "truncated); register it again"));
    }
    use.object_a = region->dev_;
    use.object_b = region->ino_;
    use.start = region->offset() + ref.offset();
  } else {
    use.object_a = UINT64_MAX;
    use.object_b = static_cast<uint64_t>(region->device_id());
    use.start = reinterpret_cast<uintptr_t>(region->data_) + ref.offset();
  }
  use.end = use.start + bytes;
  for (size_t i = 0; i + 1 < uses_.size(); ++i) {
    const Use& other = uses_[i];
    if (!(output || other.output) || other.object_a != use.object_a ||
        other.object_b != use.object_b) {
      continue;
    }
    if (use.start < other.end && other.start < use.end) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": overlaps ", other.field,
                       " in the same shared memory; an output must not share "
                       "bytes with any other tensor of the request"));
    }
  }
  RegionSpan span;
  span.data = region->data_ + ref.offset();
  span.bytes = bytes;
  span.device = device;
  span.device_id = region->device_id();
  span.pinned = region->pinned();
  return span;
}

absl::Status RegionScope::CheckIntact() const {
  for (const Use& use : uses_) {
    if (use.region->Broken() || use.region->Shrunk()) {
      return absl::FailedPreconditionError(absl::StrCat(
          use.field, ": the object of region '", use.region->name(),
          "' was truncated while the request used it; its results are not "
          "valid"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mhc::server
