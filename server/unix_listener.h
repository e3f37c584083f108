// Unix-socket listeners that accept connections themselves, so that each
// connection's peer credentials (SO_PEERCRED) are known, and hand them to
// gRPC, whose sync server would hide the socket.
//
// gRPC names a call on such a connection "fd:N" (ServerContext::peer()),
// with N the descriptor it was given. Descriptor numbers are reused once
// closed, so each connection gets a number above all recent ones (see
// ConnectionPeers) and a lookup checks that the number still holds the very
// socket that was accepted; a call whose connection is gone finds nothing.
#ifndef MHC_SERVER_UNIX_LISTENER_H_
#define MHC_SERVER_UNIX_LISTENER_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/peer_credentials.h"

namespace mhc::server {

// The connections accepted by this daemon's unix listeners and their
// peers' credentials.
class ConnectionPeers {
 public:
  ConnectionPeers();

  // Moves an accepted socket to a fresh descriptor number and records its
  // peer. Returns the new descriptor (the old one is closed either way).
  absl::StatusOr<int> Adopt(int fd, PeerCredentials peer);
  // The peer of a call whose ServerContext::peer() is `grpc_peer`; nullopt
  // unless it is a connection this daemon accepted that is still open.
  std::optional<PeerCredentials> Find(absl::string_view grpc_peer) const;
  // Connections recorded (open or not yet noticed closed), for tests.
  size_t size() const;
  // Waits until gRPC has closed every connection recorded or `deadline`
  // passes; true when none is left.
  bool AwaitClosed(absl::Time deadline);

 private:
  struct Entry {
    PeerCredentials peer;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  // Forgets connections whose descriptor no longer holds their socket.
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<int, Entry> by_fd_ ABSL_GUARDED_BY(mu_);
  // Descriptor numbers handed out climb from floor_ to ceiling_, then wrap.
  int floor_ = 0;
  int ceiling_ = 0;
  int next_ ABSL_GUARDED_BY(mu_) = 0;
};

struct UnixSocketOptions {
  mode_t mode = 0660;
  gid_t group = static_cast<gid_t>(-1);  // -1: the daemon's
};

class UnixListener {
 public:
  // Binds `path` (replacing a stale socket file, never another kind of
  // file), gives the socket file `options`' mode and group, and listens.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Bind(
      const std::string& path, const UnixSocketOptions& options,
      ConnectionPeers* peers);
  ~UnixListener();

  // Hands every accepted connection to `server` (built and started) until
  // Stop.
  void Start(grpc::Server* server);
  // Stops accepting, waits for the accept thread and removes the socket
  // file. Connections already handed over stay with gRPC.
  void Stop();

 private:
  UnixListener() = default;
  void AcceptLoop(grpc::Server* server);

  std::string path_;
  ConnectionPeers* peers_ = nullptr;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that ends the accept loop
  std::thread thread_;
  bool stopped_ = false;
};

// Parses --unix_socket_group: a group name or a numeric gid.
absl::StatusOr<gid_t> ResolveGroup(const std::string& group);

}  // namespace mhc::server

#endif  // MHC_SERVER_UNIX_LISTENER_H_
