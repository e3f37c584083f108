// Request validation of every unary RPC: the first byte picks the method
// (its index in mhc.v1.Mhc, modulo the method count), the rest is its
// request message. The call goes through the MhcService handler, as from
// gRPC, on a daemon that starts from the same layers every time.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "fuzz/in_process_daemon.h"
#include "fuzz/rpc_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const mhc::fuzz::RpcInvoker* rpc =
      mhc::fuzz::FindRpc(data[0] % mhc::fuzz::RpcCount());
  if (rpc == nullptr) return 0;
  mhc::fuzz::InProcessDaemon& daemon = mhc::fuzz::InProcessDaemon::Get();
  daemon.Reset();
  (*rpc)(daemon.service(),
         absl::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  return 0;
}
