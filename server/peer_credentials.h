// Who is on the other end of a unix-socket connection, and whether that
// user could open a file itself. The kernel vouches for the user and group
// (SO_PEERCRED); nothing the client sends is trusted for either.
#ifndef MHC_SERVER_PEER_CREDENTIALS_H_
#define MHC_SERVER_PEER_CREDENTIALS_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mhc::server {

struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;  // 0 when the peer is in a pid namespace we cannot see
  // Supplementary groups of the connecting process; empty when they could
  // not be read reliably (then only `gid` counts, which can only deny more).
  std::vector<gid_t> groups;

  // "uid=1000 gid=1000 pid=42", for logs and messages.
  std::string ToString() const;
};

// The credentials of the process that connected `fd` (a connected unix
// socket): user and group from SO_PEERCRED, supplementary groups from that
// process's /proc entry when it still belongs to the same user.
absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd);

// Parses the "Groups:" line of a /proc/PID/status text; returns false when
// the text's effective uid and gid are not `uid` and `gid` (the pid was
// reused by another process, or the process changed identity since it
// connected).
bool ParseProcStatusGroups(const std::string& status, uid_t uid, gid_t gid,
                           std::vector<gid_t>* groups);

// Whether `peer` may open the file `st` describes for reading and writing,
// by its owner, group and mode bits as the kernel checks them (root may
// always). ACLs are not consulted.
bool MayReadWrite(const PeerCredentials& peer, const struct stat& st);

}  // namespace mhc::server

#endif  // MHC_SERVER_PEER_CREDENTIALS_H_
