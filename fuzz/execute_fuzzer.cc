// Execute batches: the input is an ExecuteRequest, whose ops name earlier
// ops' outputs ("<op id>.<field>") as inputs. Runs through the Execute
// handler on a daemon that starts from the same layers every time.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "fuzz/in_process_daemon.h"
#include "fuzz/rpc_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const mhc::fuzz::RpcInvoker* execute =
      mhc::fuzz::FindRpc(mhc::fuzz::RpcIndex("Execute"));
  if (execute == nullptr) {
    std::fprintf(stderr, "execute_fuzzer: mhc.v1.Mhc has no Execute\n");
    std::abort();
  }
  mhc::fuzz::InProcessDaemon& daemon = mhc::fuzz::InProcessDaemon::Get();
  daemon.Reset();
  (*execute)(daemon.service(),
             absl::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
