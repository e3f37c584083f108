// Names of the POSIX shared-memory objects a client creates.
#ifndef MHC_CLIENT_SHM_KEY_H_
#define MHC_CLIENT_SHM_KEY_H_

#include <string>

namespace mhc::client {

// A unique key "<prefix><pid>_<nonce>_<counter>_<tag>" for objects of this
// process; the nonce, random per process, keeps it apart from the names a
// dead process of the same pid left behind.
std::string UniqueShmKey(const std::string& prefix, const std::string& tag);

}  // namespace mhc::client

#endif  // MHC_CLIENT_SHM_KEY_H_
