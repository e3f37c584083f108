// mhc_load_stream_bench: how fast persistent CTAs stream a stream-major x
// from HBM by 8 KiB tensor copies (mhc/cuda_tools.h, ProbeCudaLoadStream),
// for every combination of the listed producer threads per CTA, boxes in
// flight per producer, CTAs per SM, box widths and box orders, as a share
// of the device-to-device copy bandwidth measured in the same run. It
// bounds a kernel that holds a token tile on chip while it streams.
//
//   mhc_load_stream_bench --tokens=32768 --channels=4096 --rings=8,16
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "mhc/cuda_tools.h"

ABSL_FLAG(int32_t, device, 0, "CUDA device");
ABSL_FLAG(int64_t, tokens, 32768, "tokens of x");
ABSL_FLAG(int32_t, channels, 4096, "channels per stream (C)");
ABSL_FLAG(int32_t, streams, 4, "streams (n)");
ABSL_FLAG(int32_t, group_ctas, 1,
          "CTAs that split a token tile's channel blocks");
ABSL_FLAG(std::string, producers, "1,2", "producer threads per CTA (1-4)");
ABSL_FLAG(std::string, rings, "8,16", "boxes in flight per producer");
ABSL_FLAG(std::string, ctas_per_sm, "1,2", "CTAs per SM (as many as fit)");
ABSL_FLAG(std::string, box_channels, "64",
          "box widths in channels (64, 128, 256); 8 KiB boxes");
ABSL_FLAG(std::string, orders, "stream,block",
          "a tile's boxes stream by stream or channel block by block");
ABSL_FLAG(int32_t, reps, 5, "timed repetitions per probe (median)");

namespace {

bool ParseInts(const std::string& text, std::vector<int>* out) {
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(piece, &v) || v <= 0) return false;
    out->push_back(v);
  }
  return !out->empty();
}

bool ParseOrders(const std::string& text, std::vector<bool>* stream_major) {
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    if (piece != "stream" && piece != "block") return false;
    stream_major->push_back(piece == "stream");
  }
  return !stream_major->empty();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times HBM streams of tensor copies by producer threads, rings and "
      "CTAs per SM, on one CUDA device.");
  absl::ParseCommandLine(argc, argv);
  std::vector<int> producers, rings, ctas, widths;
  std::vector<bool> orders;
  if (!ParseInts(absl::GetFlag(FLAGS_producers), &producers) ||
      !ParseInts(absl::GetFlag(FLAGS_rings), &rings) ||
      !ParseInts(absl::GetFlag(FLAGS_ctas_per_sm), &ctas) ||
      !ParseInts(absl::GetFlag(FLAGS_box_channels), &widths) ||
      !ParseOrders(absl::GetFlag(FLAGS_orders), &orders)) {
    std::fprintf(stderr,
                 "--producers, --rings, --ctas_per_sm and --box_channels take "
                 "lists of positive integers, --orders of stream / block\n");
    return 2;
  }
  const int device = absl::GetFlag(FLAGS_device);
  std::vector<mhc::LoadStreamProbe> probes;
  for (int width : widths) {
    for (bool stream_major : orders) {
      for (int per_sm : ctas) {
        for (int threads : producers) {
          for (int ring : rings) {
            mhc::LoadStreamProbe p;
            p.tokens = absl::GetFlag(FLAGS_tokens);
            p.channels = absl::GetFlag(FLAGS_channels);
            p.streams = absl::GetFlag(FLAGS_streams);
            p.group_ctas = absl::GetFlag(FLAGS_group_ctas);
            p.ring = ring;
            p.ctas_per_sm = per_sm;
            p.producers = threads;
            p.stream_major = stream_major;
            p.box_channels = width;
            probes.push_back(p);
          }
        }
      }
    }
  }
  absl::StatusOr<double> copy = mhc::MeasureCudaCopyBandwidth(device);
  if (!copy.ok()) {
    std::fprintf(stderr, "%s\n", copy.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::vector<mhc::LoadStreamResult>> results =
      mhc::ProbeCudaLoadStream(device, probes, absl::GetFlag(FLAGS_reps));
  if (!results.ok()) {
    std::fprintf(stderr, "%s\n", results.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "x %lld tokens x %d streams x %d channels (bf16), groups of %d CTAs, "
      "copy %.0f GB/s, median of %d\n",
      static_cast<long long>(probes[0].tokens), probes[0].streams,
      probes[0].channels, probes[0].group_ctas, *copy / 1e9,
      absl::GetFlag(FLAGS_reps));
  std::printf("%6s %7s %8s %9s %5s %6s %10s %8s %8s\n", "box", "order",
              "CTAs/SM", "producers", "ring", "CTAs", "us", "GB/s", "% copy");
  for (size_t i = 0; i < probes.size(); ++i) {
    const mhc::LoadStreamProbe& p = probes[i];
    const mhc::LoadStreamResult& r = (*results)[i];
    if (r.ctas_per_sm == 0) {
      std::printf("%3dx%-3d %7s %8s %9d %5d  rings do not fit an SM\n",
                  p.BoxTokens(), p.box_channels,
                  p.stream_major ? "stream" : "block", "-", p.producers,
                  p.ring);
      continue;
    }
    const double bytes_per_s =
        static_cast<double>(p.Bytes()) / (r.median_us * 1e-6);
    if (!r.every_box_once) {
      std::fprintf(stderr, "load stream probe: a box missed or read twice\n");
      return 1;
    }
    std::printf("%3dx%-3d %7s %8d %9d %5d %6d %10.1f %8.0f %8.1f\n",
                p.BoxTokens(), p.box_channels,
                p.stream_major ? "stream" : "block", r.ctas_per_sm, p.producers,
                p.ring, r.ctas, r.median_us, bytes_per_s / 1e9,
                100.0 * bytes_per_s / *copy);
  }
  return 0;
}
