// Writes the seed corpora of the harnesses: write_seeds DIR fills
// DIR/rpc, DIR/execute and DIR/checkpoint with valid inputs (requests the
// in-process daemon accepts, checkpoints it saved). Files it does not
// write, such as kept crash reproducers, stay. Exits non-zero when a seed
// that must be valid is refused.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "fuzz/call_sequence.h"
#include "fuzz/in_process_daemon.h"
#include "fuzz/rpc_table.h"
#include "fuzz/seed_requests.h"
#include "grpcpp/server_context.h"
#include "server/checkpoint_format.h"
#include "server/op_defs.h"

namespace mhc::fuzz {
namespace {

namespace fs = std::filesystem;

bool WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  out.close();
  if (!out)
    std::fprintf(stderr, "write_seeds: cannot write %s\n", path.c_str());
  return static_cast<bool>(out);
}

bool Call(const char* what, const grpc::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "write_seeds: %s refused: %s\n", what,
                 status.error_message().c_str());
  }
  return status.ok();
}

// Runs `seed` on a fresh daemon; OK when it was accepted.
grpc::Status Run(const SeedRequest& seed) {
  InProcessDaemon& daemon = InProcessDaemon::Get();
  daemon.Reset();
  return (*FindRpc(RpcIndex(seed.rpc)))(daemon.service(), RequestBytes(seed));
}

std::string RpcInput(const SeedRequest& seed) {
  return EncodeCall(RpcIndex(seed.rpc), RequestBytes(seed));
}

// Every call on one fresh daemon; true when all were accepted.
bool RunSequence(const SeedSequence& sequence, std::string* input) {
  InProcessDaemon& daemon = InProcessDaemon::Get();
  daemon.Reset();
  for (const SeedRequest& call : sequence.calls) {
    const std::string what = absl::StrCat(sequence.label, ": ", call.label);
    if (!Call(what.c_str(), (*FindRpc(RpcIndex(call.rpc)))(
                                daemon.service(), RequestBytes(call)))) {
      return false;
    }
    *input += RpcInput(call);
  }
  return true;
}

// A single op as a batch of one.
std::string OneOpBatch(const SeedRequest& seed) {
  v1::ExecuteRequest batch;
  v1::Op* op = batch.add_ops();
  op->set_id("op");
  for (int field = 2;; ++field) {
    const server::OpDef* def = server::FindOpDefByOpField(field);
    if (def == nullptr) break;
    if (def->rpc != seed.rpc) continue;
    op->GetReflection()
        ->MutableMessage(op, v1::Op::descriptor()->FindFieldByNumber(field))
        ->CopyFrom(*seed.request);
  }
  return batch.SerializeAsString();
}

// Checkpoints of the fixture layers after a training step: with gradients
// and AdamW state, and parameters alone.
bool WriteCheckpoints(const fs::path& dir) {
  InProcessDaemon& daemon = InProcessDaemon::Get();
  daemon.Reset();
  for (const SeedRequest& seed : BatchSeeds()) {
    if (!Call(seed.label.c_str(), (*FindRpc(RpcIndex(seed.rpc)))(
                                      daemon.service(), RequestBytes(seed)))) {
      return false;
    }
  }
  v1::OptimizerStepRequest step;
  step.add_layers("l0");
  step.set_learning_rate(0.01f);
  step.mutable_adamw();
  v1::OptimizerStepResponse stepped;
  grpc::ServerContext step_context;
  if (!Call("OptimizerStep",
            daemon.service().OptimizerStep(&step_context, &step, &stepped))) {
    return false;
  }
  for (bool full : {true, false}) {
    v1::SaveCheckpointRequest save;
    save.set_name(full ? "full" : "params");
    save.set_include_gradients(full);
    save.set_skip_optimizer_state(!full);
    v1::SaveCheckpointResponse saved;
    grpc::ServerContext context;
    if (!Call("SaveCheckpoint",
              daemon.service().SaveCheckpoint(&context, &save, &saved))) {
      return false;
    }
    const fs::path file =
        fs::path(daemon.state_dir()) /
        absl::StrCat(save.name(), server::kCheckpointExtension);
    std::ifstream in(file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)),
                            std::istreambuf_iterator<char>());
    if (bytes.empty() || !WriteFile(dir / save.name(), bytes)) return false;
  }
  return true;
}

int Main(const fs::path& root) {
  for (const char* harness : {"rpc", "execute", "checkpoint"}) {
    fs::create_directories(root / harness);
  }
  int rpc_seeds = 0, batch_seeds = 0, refused = 0;
  std::set<std::string> written;
  for (const SeedRequest& seed : OpSeedCandidates()) {
    // Candidates a layer does not accept (a static layer's projection)
    // are no seeds; an op without optional inputs gives the same request
    // twice.
    if (!written.insert(RpcInput(seed)).second) continue;
    if (!Run(seed).ok()) {
      ++refused;
      continue;
    }
    if (!WriteFile(root / "rpc" / seed.label, RpcInput(seed)) ||
        !WriteFile(root / "execute" / seed.label, OneOpBatch(seed))) {
      return 1;
    }
    ++rpc_seeds;
    ++batch_seeds;
  }
  std::vector<SeedRequest> required = BatchSeeds();
  for (SeedRequest& seed : ManagementSeeds()) required.push_back(seed);
  for (const SeedRequest& seed : required) {
    if (!Call(seed.label.c_str(), Run(seed))) return 1;
    if (!WriteFile(root / "rpc" / seed.label, RpcInput(seed))) return 1;
    ++rpc_seeds;
    if (seed.rpc == "Execute") {
      if (!WriteFile(root / "execute" / seed.label,
                     seed.request->SerializeAsString())) {
        return 1;
      }
      ++batch_seeds;
    }
  }
  for (const SeedSequence& sequence : SequenceSeeds()) {
    std::string input;
    if (!RunSequence(sequence, &input) ||
        !WriteFile(root / "rpc" / sequence.label, input)) {
      return 1;
    }
    ++rpc_seeds;
  }
  if (!WriteCheckpoints(root / "checkpoint")) return 1;
  std::printf(
      "write_seeds: %d rpc, %d execute and 2 checkpoint seeds in %s (%d op "
      "candidates refused)\n",
      rpc_seeds, batch_seeds, root.c_str(), refused);
  return 0;
}

}  // namespace
}  // namespace mhc::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  return mhc::fuzz::Main(argv[1]);
}
