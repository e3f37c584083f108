#include "server/shm/shm_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace mhc::server::shm_guard {
namespace {

// Read by the signal handler, so plain atomics only: no locks, no
// allocation. A slot is claimed by storing a non-zero base last.
struct Slot {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> bytes{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[kMaxWatched];
std::mutex g_claim_mu;  // serializes Watch; the handler never takes it
uintptr_t g_page_mask = ~uintptr_t{4095};
struct sigaction g_previous;

void OnSigbus(int signal_number, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& slot : g_slots) {
    const uintptr_t base = slot.base.load(std::memory_order_acquire);
    if (base == 0 || addr < base ||
        addr - base >= slot.bytes.load(std::memory_order_relaxed)) {
      continue;
    }
    void* page = reinterpret_cast<void*>(addr & g_page_mask);
    void* mapped = mmap(page, ~g_page_mask + 1, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (mapped != MAP_FAILED) {
      slot.faulted.store(true, std::memory_order_release);
      return;  // the faulting access is retried on the zero page
    }
    break;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 &&
      g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal_number, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signal_number);
    return;
  }
  // Not ours: restore the default action; the access faults again and the
  // process dies with SIGBUS as it would have without this handler.
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

void Install() {
  static std::once_flag once;
  std::call_once(once, [] {
    const long page = sysconf(_SC_PAGESIZE);
    if (page > 0) g_page_mask = ~(static_cast<uintptr_t>(page) - 1);
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

int Watch(void* base, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_claim_mu);
  for (int i = 0; i < kMaxWatched; ++i) {
    Slot& slot = g_slots[i];
    if (slot.base.load(std::memory_order_relaxed) != 0) continue;
    slot.faulted.store(false, std::memory_order_relaxed);
    slot.bytes.store(bytes, std::memory_order_relaxed);
    slot.base.store(reinterpret_cast<uintptr_t>(base),
                    std::memory_order_release);
    return i;
  }
  return -1;
}

void Unwatch(int slot) {
  if (slot < 0 || slot >= kMaxWatched) return;
  g_slots[slot].base.store(0, std::memory_order_release);
}

bool Faulted(int slot) {
  if (slot < 0 || slot >= kMaxWatched) return false;
  return g_slots[slot].faulted.load(std::memory_order_acquire);
}

}  // namespace mhc::server::shm_guard
