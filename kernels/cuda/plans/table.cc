// What the plans' tables share.
#include "plans/table.h"

#include <algorithm>

#include "projection/plan.h"

namespace mhc::cuda {

LayerSpec LayerExample::Spec() const {
  LayerSpec spec = PresetSpec(preset, n, hidden).value();
  spec.kind = kind;
  spec.dynamic = dynamic;
  return spec;
}

int LeastAlignment(std::initializer_list<const void*> tensors) {
  int least = 16;
  for (const void* tensor : tensors) {
    least = std::min(least, AddressAlignment(tensor));
  }
  return least;
}

}  // namespace mhc::cuda
