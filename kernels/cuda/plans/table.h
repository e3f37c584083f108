// What the kernel plans of this folder share: a table row (the condition in
// the docs' words, the variant it picks, where the kernel is, how it works,
// and a launch the condition holds for), and the ordered rules each plan
// walks, first that holds wins. Plain C++, so that tests and the docs
// generator enumerate the tables without a GPU.
#ifndef MHC_KERNELS_CUDA_PLANS_TABLE_H_
#define MHC_KERNELS_CUDA_PLANS_TABLE_H_

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "mhc/types.h"

namespace mhc::cuda {

// A launch a row's condition holds for, first in its table: a preset's
// layer with the row's changes, the dtype, and where the tensors start.
struct LayerExample {
  const char* preset = "deepseek_v4";
  LayerKind kind = LayerKind::kMhc;
  int n = 4;
  int64_t hidden = 256;
  DType dtype = DType::kBF16;
  bool dynamic = true;
  // The largest power of two up to 16 dividing the address of every tensor
  // the plan reads (the dispatch test places them so).
  int alignment = 16;
  LayerSpec Spec() const;
};

template <typename Variant>
struct PlanRow {
  Variant variant;
  const char* when;  // the condition, in the docs' words
  const char* code;  // where the kernel is
  const char* what;  // how it works, in a line
  LayerExample example;
};

// The smallest AddressAlignment (projection/plan.h) of the tensors: 16
// when every one starts on 16 bytes. Nulls constrain nothing.
int LeastAlignment(std::initializer_list<const void*> tensors);

// A row and the condition it stands for, on what a plan derives from its
// launch (`Case`). Each table's last rule holds always.
template <typename Variant, typename Case>
struct PlanRule {
  PlanRow<Variant> row;
  bool (*holds)(const Case& c);
};

template <typename Variant, typename Case>
int FirstRowThatHolds(const std::vector<PlanRule<Variant, Case>>& rules,
                      const Case& c) {
  for (size_t i = 0; i < rules.size(); ++i) {
    if (rules[i].holds(c)) return static_cast<int>(i);
  }
  return static_cast<int>(rules.size()) - 1;
}

template <typename Variant, typename Case>
std::vector<PlanRow<Variant>> RowsOf(
    const std::vector<PlanRule<Variant, Case>>& rules) {
  std::vector<PlanRow<Variant>> rows;
  for (const auto& rule : rules) rows.push_back(rule.row);
  return rows;
}

}  // namespace mhc::cuda

#endif  // MHC_KERNELS_CUDA_PLANS_TABLE_H_
