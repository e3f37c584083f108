// Request validation of every unary RPC, a few calls in a row (see
// call_sequence.h): each goes through the MhcService handler, as from
// gRPC, on a daemon that starts from the same layers for every input.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "fuzz/call_sequence.h"
#include "fuzz/in_process_daemon.h"
#include "fuzz/rpc_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mhc::fuzz::InProcessDaemon& daemon = mhc::fuzz::InProcessDaemon::Get();
  daemon.Reset();
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  for (const mhc::fuzz::Call& call :
       mhc::fuzz::SplitCalls(input, mhc::fuzz::RpcCount())) {
    const mhc::fuzz::RpcInvoker* rpc = mhc::fuzz::FindRpc(call.method);
    if (rpc != nullptr) (*rpc)(daemon.service(), call.request);
  }
  return 0;
}
