// Turns a fault on a client's shared-memory mapping into a flag instead of a
// crash.
//
// A POSIX shared-memory object can be truncated by its owner at any time;
// touching a mapped page past the new end raises SIGBUS, which would take
// the whole daemon (and every other client) down. Every use re-checks the
// object's size first, but a truncation between that check and the access
// is still possible. The SIGBUS handler installed here looks the faulting
// address up in a lock-free table of watched mappings and, when it belongs
// to one, maps a private zero page over it and marks the mapping faulted:
// the access completes on scratch memory and the request reports the
// region as broken. Faults anywhere else go to the previous handler.
#ifndef MHC_SERVER_SHM_SHM_GUARD_H_
#define MHC_SERVER_SHM_SHM_GUARD_H_

#include <cstddef>

namespace mhc::server::shm_guard {

// Installs the SIGBUS handler once per process (later calls do nothing).
void Install();

// Watches [base, base + bytes); returns a slot, or -1 when the table is
// full.
int Watch(void* base, size_t bytes);
// Stops watching; call before unmapping.
void Unwatch(int slot);
// Whether a fault was absorbed in the slot's mapping since Watch.
bool Faulted(int slot);

// Size of the watch table.
inline constexpr int kMaxWatched = 4096;

}  // namespace mhc::server::shm_guard

#endif  // MHC_SERVER_SHM_SHM_GUARD_H_
