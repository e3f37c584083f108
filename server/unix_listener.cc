#include "server/unix_listener.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/server_posix.h"
#include "server/log.h"

namespace mhc::server {
namespace {

// Descriptor numbers above every other the process is likely to hold, and
// few enough that the kernel's descriptor table stays small.
constexpr int kPreferredFloor = 1024;
constexpr int kPreferredCeiling = 65536;

// Raises the soft descriptor limit to the hard one (connections are
// numbered high) and returns the soft limit now in force.
int RaiseDescriptorLimit() {
  rlimit limit = {};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = std::min<rlim_t>(limit.rlim_max, kPreferredCeiling);
    if (raised.rlim_cur > limit.rlim_cur &&
        setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      limit = raised;
    }
  }
  if (limit.rlim_cur == RLIM_INFINITY) return kPreferredCeiling;
  return static_cast<int>(
      std::min<rlim_t>(limit.rlim_cur, static_cast<rlim_t>(kPreferredCeiling)));
}

bool SameFile(int fd, dev_t dev, ino_t ino) {
  struct stat st = {};
  return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == dev &&
         st.st_ino == ino;
}

}  // namespace

ConnectionPeers::ConnectionPeers() {
  ceiling_ = RaiseDescriptorLimit();
  floor_ = std::min(kPreferredFloor, ceiling_ / 2);
  next_ = floor_;
}

absl::StatusOr<int> ConnectionPeers::Adopt(int fd, PeerCredentials peer) {
  absl::MutexLock lock(&mu_);
  Sweep();
  if (next_ >= ceiling_) next_ = floor_;
  // The lowest free number at or above next_; wraps once when the top of
  // the range is taken.
  int moved = fcntl(fd, F_DUPFD_CLOEXEC, next_);
  if (moved < 0 && next_ != floor_) moved = fcntl(fd, F_DUPFD_CLOEXEC, floor_);
  const int error = errno;
  close(fd);
  if (moved < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no descriptor free for a new connection: ", std::strerror(error)));
  }
  next_ = moved + 1;
  struct stat st = {};
  if (fstat(moved, &st) != 0) {
    close(moved);
    return absl::InternalError(
        absl::StrCat("fstat of a new connection: ", std::strerror(errno)));
  }
  by_fd_[moved] = Entry{std::move(peer), st.st_dev, st.st_ino};
  return moved;
}

void ConnectionPeers::Sweep() {
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    if (SameFile(it->first, it->second.dev, it->second.ino)) {
      ++it;
    } else {
      it = by_fd_.erase(it);
    }
  }
}

std::optional<PeerCredentials> ConnectionPeers::Find(
    absl::string_view grpc_peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&grpc_peer, "fd:") ||
      !absl::SimpleAtoi(grpc_peer, &fd)) {
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end() || !SameFile(fd, it->second.dev, it->second.ino)) {
    return std::nullopt;
  }
  return it->second.peer;
}

size_t ConnectionPeers::size() const {
  absl::MutexLock lock(&mu_);
  return by_fd_.size();
}

bool ConnectionPeers::AwaitClosed(absl::Time deadline) {
  // Polled: it runs once, at the end of a drain.
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      Sweep();
      if (by_fd_.empty()) return true;
    }
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
}

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Bind(
    const std::string& path, const UnixSocketOptions& options,
    ConnectionPeers* peers) {
  sockaddr_un addr = {};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: socket path 'unix:", path, "' must be 1..",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  struct stat existing = {};
  if (lstat(path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--listen: unix:", path, " exists and is not a socket"));
    }
    unlink(path.c_str());  // stale: the caller checked nobody serves on it
  }
  std::unique_ptr<UnixListener> listener(new UnixListener());
  listener->path_ = path;
  listener->peers_ = peers;
  listener->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  listener->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (listener->listen_fd_ < 0 || listener->wake_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat("--listen: socket: ", std::strerror(errno)));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (bind(listener->listen_fd_, reinterpret_cast<sockaddr*>(&addr),
           sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen: cannot bind unix:", path, ": ", std::strerror(errno)));
  }
  // Nobody can connect before listen(), so the mode and group are in place
  // before the first client arrives, whatever the umask made of them.
  if (options.group != static_cast<gid_t>(-1) &&
      chown(path.c_str(), static_cast<uid_t>(-1), options.group) != 0) {
    const int error = errno;
    unlink(path.c_str());
    return absl::PermissionDeniedError(
        absl::StrCat("--unix_socket_group: cannot give unix:", path, " group ",
                     options.group, ": ", std::strerror(error)));
  }
  if (chmod(path.c_str(), options.mode) != 0 ||
      listen(listener->listen_fd_, SOMAXCONN) != 0) {
    const int error = errno;
    unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat(
        "--listen: cannot listen on unix:", path, ": ", std::strerror(error)));
  }
  return listener;
}

UnixListener::~UnixListener() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void UnixListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixListener::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
    unlink(path_.c_str());
  }
}

void UnixListener::AcceptLoop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Log(LogLevel::kError, "unix listener stopped",
          {{"socket", path_}, {"error", std::strerror(errno)}});
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    const int fd =
        accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors or memory: wait instead of spinning.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        absl::SleepFor(absl::Milliseconds(50));
      }
      continue;
    }
    absl::StatusOr<PeerCredentials> peer = ReadPeerCredentials(fd);
    if (!peer.ok()) {
      close(fd);
      Log(LogLevel::kWarning, "connection refused",
          {{"socket", path_}, {"error", peer.status().message()}});
      continue;
    }
    absl::StatusOr<int> adopted = peers_->Adopt(fd, *std::move(peer));
    if (!adopted.ok()) {
      Log(LogLevel::kWarning, "connection refused",
          {{"socket", path_}, {"error", adopted.status().message()}});
      continue;
    }
    grpc::AddInsecureChannelFromFd(server, *adopted);
  }
}

absl::StatusOr<gid_t> ResolveGroup(const std::string& group) {
  uint32_t gid = 0;
  if (absl::SimpleAtoi(group, &gid)) return static_cast<gid_t>(gid);
  std::vector<char> buffer(16384);
  struct group entry = {};
  struct group* found = nullptr;
  const int error =
      getgrnam_r(group.c_str(), &entry, buffer.data(), buffer.size(), &found);
  if (error != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--unix_socket_group: no group named '", group, "'"));
  }
  return found->gr_gid;
}

}  // namespace mhc::server
