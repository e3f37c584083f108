// Recomputes the checksums of a checkpoint file image (the layers'
// metadata CRC and every in-bounds tensor's CRC, see docs/checkpoints.md),
// so that the checkpoint harness's mutations of the manifest and tensor
// data reach the checks behind the checksums instead of stopping at them.
#ifndef MHC_FUZZ_CHECKPOINT_CHECKSUMS_H_
#define MHC_FUZZ_CHECKPOINT_CHECKSUMS_H_

#include <string>

namespace mhc::fuzz {

// False (and `file` unchanged) when its header is not a JSON object with
// a __metadata__ object.
bool FixCheckpointChecksums(std::string* file);

}  // namespace mhc::fuzz

#endif  // MHC_FUZZ_CHECKPOINT_CHECKSUMS_H_
