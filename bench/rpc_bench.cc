// mhc_rpc_bench: round trip of one Aggregate RPC with its tensors inline
// versus in POSIX shared memory, for x of 1 KiB to 256 MiB.
//
// The daemon runs in this process (the same MhcServer mhcd runs, cpu
// backend) on a unix socket; the client reaches it through gRPC like any
// other local client. Aggregate reads x [M, n, C] and h_pre [M, n] and writes
// y [M, C], so a round trip moves 1.25x the bytes of x each way inline and
// none through gRPC with shared memory. Prints a Markdown table (median of
// the repetitions, after one warm-up).
//
//   mhc_rpc_bench [--max_mib=256] [--threads=0]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mhc/client/client.h"
#include "mhc/client/shm.h"
#include "mhc/client/tensor.h"
#include "server/server.h"

namespace {

using mhc::DType;
using mhc::client::Client;

constexpr int kN = 4;
constexpr int64_t kC = 64;  // one token of x is n * C * 4 = 1 KiB

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "mhc_rpc_bench: %s\n", status.ToString().c_str());
  return 1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string Size(uint64_t bytes) {
  if (bytes >= (1 << 20)) return absl::StrCat(bytes >> 20, " MiB");
  return absl::StrCat(bytes >> 10, " KiB");
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mib = 256;
  int threads = 0;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::ConsumePrefix(&arg, "--max_mib=")) {
      if (!absl::SimpleAtoi(arg, &max_mib) || max_mib < 1) return 2;
    } else if (absl::ConsumePrefix(&arg, "--threads=")) {
      if (!absl::SimpleAtoi(arg, &threads)) return 2;
    } else {
      std::fprintf(stderr,
                   "usage: mhc_rpc_bench [--max_mib=256] "
                   "[--threads=0]\n");
      return 2;
    }
  }
  mhc::server::ServerConfig config;
  const std::string socket = absl::StrCat("/tmp/mhc_rpc_bench_", getpid());
  config.listen.push_back(absl::StrCat("unix:", socket));
  config.service.shm.enabled = true;
  std::vector<mhc::server::DeviceBackend> devices;
  devices.push_back({"cpu", mhc::MakeCpuBackend(threads)});
  auto server = mhc::server::MhcServer::Start(config, std::move(devices));
  if (!server.ok()) return Fail(server.status());
  auto client = Client::Connect(config.listen[0]);
  if (!client.ok()) return Fail(client.status());
  mhc::v1::CreateLayerRequest layer;
  layer.set_name("bench");
  layer.mutable_spec()->set_n(kN);
  layer.mutable_spec()->set_hidden(kC);
  if (auto info = (*client)->CreateLayer(layer); !info.ok()) {
    return Fail(info.status());
  }
  auto session = mhc::client::Session::Open(**client);
  if (!session.ok()) return Fail(session.status());

  std::printf(
      "| x | inline ms | shared memory ms | speedup | inline GB/s (x) |\n"
      "|---|---|---|---|---|\n");
  for (uint64_t x_bytes = 1024; x_bytes <= (uint64_t(max_mib) << 20);
       x_bytes *= 4) {
    const int64_t m = static_cast<int64_t>(x_bytes / (kN * kC * 4));
    const uint64_t h_bytes = m * kN * 4, y_bytes = m * kC * 4;
    const int reps = x_bytes <= (1 << 20)    ? 200
                     : x_bytes <= (16 << 20) ? 20
                                             : 5;
    auto x = mhc::client::RandomTensor(DType::kF32, {m, kN, kC}, 1);
    auto h = mhc::client::RandomTensor(DType::kF32, {m, kN}, 2);

    mhc::v1::AggregateRequest inline_request;
    inline_request.set_layer("bench");
    *inline_request.mutable_x() = mhc::client::ToTensorRef(x);
    *inline_request.mutable_h_pre() = mhc::client::ToTensorRef(h);

    auto object = mhc::client::SharedMemoryObject::Create(
        mhc::client::UniqueShmKey("mhcd_bench_", "agg"),
        x_bytes + h_bytes + y_bytes);
    if (!object.ok()) return Fail(object.status());
    std::memcpy((*object)->data(), x.bytes.data(), x_bytes);
    std::memcpy((*object)->data() + x_bytes, h.bytes.data(), h_bytes);
    absl::Status registered = (*client)->RegisterSystemSharedMemory(
        "agg", (*object)->key(), 0, (*object)->size());
    if (!registered.ok()) return Fail(registered);
    mhc::v1::AggregateRequest shm_request;
    shm_request.set_layer("bench");
    *shm_request.mutable_x() =
        mhc::client::ShmTensorRef(DType::kF32, {m, kN, kC}, "agg", 0);
    *shm_request.mutable_h_pre() =
        mhc::client::ShmTensorRef(DType::kF32, {m, kN}, "agg", x_bytes);
    (*shm_request.mutable_output_regions())["y"] =
        mhc::client::ShmRef("agg", x_bytes + h_bytes, y_bytes);

    std::vector<double> inline_ms, shm_ms;
    for (int rep = 0; rep <= reps; ++rep) {
      absl::Time start = absl::Now();
      auto a = (*client)->Aggregate(inline_request);
      if (!a.ok()) return Fail(a.status());
      const double t_inline = absl::ToDoubleMilliseconds(absl::Now() - start);
      start = absl::Now();
      auto b = (*client)->Aggregate(shm_request);
      if (!b.ok()) return Fail(b.status());
      const double t_shm = absl::ToDoubleMilliseconds(absl::Now() - start);
      if (rep == 0) {
        // Warm-up, and the check that both paths computed the same y.
        if (std::memcmp(a->y().inline_data().data(),
                        (*object)->data() + x_bytes + h_bytes, y_bytes) != 0) {
          return Fail(absl::InternalError("inline and shm results differ"));
        }
        continue;
      }
      inline_ms.push_back(t_inline);
      shm_ms.push_back(t_shm);
    }
    auto unregistered = (*client)->UnregisterSharedMemory("agg");
    if (!unregistered.ok()) return Fail(unregistered.status());
    const double mi = Median(inline_ms), ms = Median(shm_ms);
    std::printf("| %s | %.3f | %.3f | %.1fx | %.2f |\n", Size(x_bytes).c_str(),
                mi, ms, mi / ms, x_bytes / (mi * 1e6));
    std::fflush(stdout);
  }
  (void)(*session)->Close();
  (*server)->Drain(absl::Seconds(5));
  unlink(socket.c_str());
  return 0;
}
