// The checkpoint reader: the input is a checkpoint file. It is written to
// the daemon's checkpoint directory and loaded with LoadCheckpoint (header
// parse and checks, manifest, tensor bounds and checksums, layer rebuild,
// replacing the fixture layers of the same names), then listed.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/in_process_daemon.h"
#include "fuzz/rpc_table.h"
#include "grpcpp/server_context.h"
#include "server/checkpoint_format.h"

namespace {

void WriteFile(const std::string& path, const uint8_t* data, size_t size) {
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr ||
      (size > 0 && std::fwrite(data, 1, size, file) != size) ||
      std::fclose(file) != 0) {
    std::fprintf(stderr, "checkpoint_fuzzer: cannot write %s\n", path.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mhc::fuzz::InProcessDaemon& daemon = mhc::fuzz::InProcessDaemon::Get();
  daemon.Reset();
  WriteFile(daemon.state_dir() + "/fuzz" + mhc::server::kCheckpointExtension,
            data, size);
  mhc::v1::LoadCheckpointRequest load;
  load.set_name("fuzz");
  load.set_replace(true);
  mhc::v1::LoadCheckpointResponse loaded;
  grpc::ServerContext load_context;
  mhc::fuzz::AbortOnDaemonBug(
      "LoadCheckpoint",
      daemon.service().LoadCheckpoint(&load_context, &load, &loaded));
  mhc::v1::ListCheckpointsRequest list;
  mhc::v1::ListCheckpointsResponse listed;
  grpc::ServerContext list_context;
  mhc::fuzz::AbortOnDaemonBug(
      "ListCheckpoints",
      daemon.service().ListCheckpoints(&list_context, &list, &listed));
  return 0;
}
