// Valid requests against the fuzz daemon's fixture layers, the starting
// points of the seed corpora: every op on every layer it applies to, in
// f32 and bf16, and Execute batches whose ops consume earlier outputs by
// reference.
#ifndef MHC_FUZZ_SEED_REQUESTS_H_
#define MHC_FUZZ_SEED_REQUESTS_H_

#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "mhc/v1/service.pb.h"

namespace mhc::fuzz {

struct SeedRequest {
  std::string label;  // file name in the corpus: "Pre-l0-f32"
  std::string rpc;    // method of mhc.v1.Mhc
  std::shared_ptr<google::protobuf::Message> request;
  // Client-streaming RPCs: the pieces in order (`request` is null).
  std::vector<std::shared_ptr<google::protobuf::Message>> pieces;
};

// What the harness hands the RPC: the serialized request, or the pieces as
// EncodeStream writes them.
std::string RequestBytes(const SeedRequest& seed);

// Single-op requests: each op on each fixture layer it accepts, with and
// without its optional inputs. Not every candidate is valid (a static
// layer has no projection); the caller keeps those the daemon accepts.
std::vector<SeedRequest> OpSeedCandidates();

// Execute batches chaining ops through references ("pre.h_post").
std::vector<SeedRequest> BatchSeeds();

// Layer management, parameters, optimizer, checkpoints and groups.
std::vector<SeedRequest> ManagementSeeds();

// Calls that build on each other: ops on a layer of an unusual spec created
// just before, on a converted layer, a save followed by a load, an
// optimizer step after a backward pass.
struct SeedSequence {
  std::string label;
  std::vector<SeedRequest> calls;
};
std::vector<SeedSequence> SequenceSeeds();

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_SEED_REQUESTS_H_
