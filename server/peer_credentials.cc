#include "server/peer_credentials.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace mhc::server {
namespace {

// The effective id of a "Uid:" or "Gid:" line: real, effective, saved, fs.
bool EffectiveId(absl::string_view values, uint32_t* id) {
  std::vector<absl::string_view> fields =
      absl::StrSplit(values, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  return fields.size() >= 2 && absl::SimpleAtoi(fields[1], id);
}

}  // namespace

std::string PeerCredentials::ToString() const {
  return absl::StrCat("uid=", uid, " gid=", gid, " pid=", pid);
}

bool ParseProcStatusGroups(const std::string& status, uid_t uid, gid_t gid,
                           std::vector<gid_t>* groups) {
  bool uid_matches = false;
  bool gid_matches = false;
  bool has_groups = false;
  std::vector<gid_t> parsed;
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    uint32_t id = 0;
    if (absl::ConsumePrefix(&line, "Uid:")) {
      uid_matches = EffectiveId(line, &id) && id == uid;
    } else if (absl::ConsumePrefix(&line, "Gid:")) {
      gid_matches = EffectiveId(line, &id) && id == gid;
    } else if (absl::ConsumePrefix(&line, "Groups:")) {
      has_groups = true;
      for (absl::string_view item :
           absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
        if (!absl::SimpleAtoi(item, &id)) return false;
        parsed.push_back(id);
      }
    }
  }
  if (!uid_matches || !gid_matches || !has_groups) return false;
  *groups = std::move(parsed);
  return true;
}

absl::StatusOr<PeerCredentials> ReadPeerCredentials(int fd) {
  ucred cred = {};
  socklen_t length = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
    return absl::InternalError(
        absl::StrCat("SO_PEERCRED: ", std::strerror(errno)));
  }
  PeerCredentials peer;
  peer.uid = cred.uid;
  peer.gid = cred.gid;
  peer.pid = cred.pid;
  if (peer.pid > 0) {
    std::ifstream file(absl::StrCat("/proc/", peer.pid, "/status"));
    std::stringstream text;
    text << file.rdbuf();
    std::vector<gid_t> groups;
    if (file &&
        ParseProcStatusGroups(text.str(), peer.uid, peer.gid, &groups)) {
      peer.groups = std::move(groups);
    }
  }
  return peer;
}

bool MayReadWrite(const PeerCredentials& peer, const struct stat& st) {
  if (peer.uid == 0) return true;
  // Like the kernel: the owner's bits decide for the owner, the group's for
  // members, and only everyone else gets the other bits.
  mode_t needed = S_IROTH | S_IWOTH;
  if (st.st_uid == peer.uid) {
    needed = S_IRUSR | S_IWUSR;
  } else if (st.st_gid == peer.gid ||
             std::find(peer.groups.begin(), peer.groups.end(), st.st_gid) !=
                 peer.groups.end()) {
    needed = S_IRGRP | S_IWGRP;
  }
  return (st.st_mode & needed) == needed;
}

}  // namespace mhc::server
