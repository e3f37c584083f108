// mhc_rpc_bench: round trip of an Execute of Aggregate ops with their
// tensors inline versus in POSIX shared memory, for x of 1 KiB to 256 MiB.
//
// The daemon runs in this process (the same MhcServer mhcd runs) on a unix
// socket, on the cpu backend or on a CUDA device; the client reaches it
// through gRPC like any other local client. Aggregate reads x [M, n, C] and
// h_pre [M, n] and writes y [M, C], so a round trip moves 1.25x the bytes of
// x each way inline and none through gRPC with shared memory. On a CUDA
// device the daemon copies host tensors to and from the GPU: page-locked
// regions (the default; --shm_pin_host=false measures pageable copies) make
// those copies asynchronous, and with --batch=K one Execute of K Aggregates
// over K slices of the same bytes lets the copies of some overlap the
// compute of others. Prints a Markdown table (median of the repetitions,
// after one warm-up that also checks that both paths give the same bytes).
//
//   mhc_rpc_bench [--max_mib=256] [--threads=0] [--backend=cpu|cuda]
//                 [--device=0] [--shm_pin_host=true] [--batch=1]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_flags.h"
#include "mhc/client/client.h"
#include "mhc/client/shm.h"
#include "mhc/client/tensor.h"
#include "server/server.h"
#ifdef MHC_HAVE_CUDA
#include "mhc/cuda.h"
#endif

ABSL_FLAG(int64_t, max_mib, 256, "largest x, in MiB (from 1 KiB up)");
ABSL_FLAG(int32_t, threads, 0, "cpu backend threads (0: all cores)");
ABSL_FLAG(std::string, backend, "cpu", "daemon backend: cpu or cuda");
ABSL_FLAG(int32_t, device, 0, "CUDA device with --backend=cuda");
ABSL_FLAG(bool, shm_pin_host, true,
          "page-lock shared memory on a CUDA daemon (false: pageable)");
ABSL_FLAG(int32_t, batch, 1, "Aggregate ops per Execute");

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

// The daemon's one device: the cpu backend, or CUDA device `device`.
absl::StatusOr<mhc::server::DeviceBackend> MakeDevice(const std::string& name,
                                                      int threads, int device) {
  if (name == "cpu") {
    return mhc::server::DeviceBackend{"cpu", mhc::MakeCpuBackend(threads)};
  }
  if (name != "cuda") {
    return absl::InvalidArgumentError("--backend: expected cpu or cuda");
  }
#ifdef MHC_HAVE_CUDA
  auto backend = mhc::MakeCudaBackend(device);
  if (!backend.ok()) return backend.status();
  return mhc::server::DeviceBackend{absl::StrCat("cuda:", device),
                                    std::move(*backend), device};
#else
  (void)device;
  return absl::FailedPreconditionError(
      "--backend=cuda: this build has no CUDA backend");
#endif
}

// One Execute of `batch` Aggregates, op k on tokens [k*M/K, (k+1)*M/K) of
// x and h: inline, or with `shm` from and into region "agg", laid out as x,
// h, y.
mhc::v1::ExecuteRequest MakeBatch(int batch, int64_t m,
                                  const mhc::client::HostTensor& x,
                                  const mhc::client::HostTensor& h, bool shm) {
  const int64_t part = m / batch;
  const uint64_t x_part = part * kN * kC * 4, h_part = part * kN * 4,
                 y_part = part * kC * 4;
  const uint64_t x_bytes = x_part * batch, h_bytes = h_part * batch;
  mhc::v1::ExecuteRequest request;
  for (int k = 0; k < batch; ++k) {
    mhc::v1::Op* op = request.add_ops();
    op->set_id(absl::StrCat("agg", k));
    mhc::v1::AggregateRequest* agg = op->mutable_aggregate();
    agg->set_layer("bench");
    if (shm) {
      *agg->mutable_x() = mhc::client::ShmTensorRef(DType::kF32, {part, kN, kC},
                                                    "agg", k * x_part);
      *agg->mutable_h_pre() = mhc::client::ShmTensorRef(
          DType::kF32, {part, kN}, "agg", x_bytes + k * h_part);
      (*agg->mutable_output_regions())["y"] =
          mhc::client::ShmRef("agg", x_bytes + h_bytes + k * y_part, y_part);
    } else {
      mhc::v1::TensorRef* xr = agg->mutable_x();
      xr->set_dtype(mhc::v1::DTYPE_F32);
      for (int64_t d : {part, int64_t{kN}, kC}) xr->add_shape(d);
      xr->set_inline_data(x.bytes.substr(k * x_part, x_part));
      mhc::v1::TensorRef* hr = agg->mutable_h_pre();
      hr->set_dtype(mhc::v1::DTYPE_F32);
      for (int64_t d : {part, int64_t{kN}}) hr->add_shape(d);
      hr->set_inline_data(h.bytes.substr(k * h_part, h_part));
    }
  }
  return request;
}

}  // namespace

int main(int argc, char** argv) {
  if (!mhc::bench::ParseBenchFlags(
          argc, argv, "rpc_bench.cc",
          "an Aggregate round trip through mhcd, inline vs shared memory")) {
    return 2;
  }
  const int64_t max_mib = absl::GetFlag(FLAGS_max_mib);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int device = absl::GetFlag(FLAGS_device);
  const int batch = absl::GetFlag(FLAGS_batch);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const bool pin_host = absl::GetFlag(FLAGS_shm_pin_host);
  if (max_mib < 1 || batch < 1) {
    std::fprintf(stderr, "mhc_rpc_bench: --max_mib and --batch: at least 1\n");
    return 2;
  }
  mhc::server::ServerConfig config;
  const std::string socket = absl::StrCat("/tmp/mhc_rpc_bench_", getpid());
  config.listen.push_back(absl::StrCat("unix:", socket));
  config.service.shm.enabled = true;
  config.service.shm.pin_host = pin_host;
  auto made = MakeDevice(backend, threads, device);
  if (!made.ok()) return Fail(made.status());
  const std::string description = made->backend->DeviceDescription();
  const bool host = made->backend->HostAccessible();
  std::vector<mhc::server::DeviceBackend> devices;
  devices.push_back(std::move(*made));
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

  bool header = false;
  for (uint64_t x_bytes = 1024; x_bytes <= (uint64_t(max_mib) << 20);
       x_bytes *= 4) {
    const int64_t m = static_cast<int64_t>(x_bytes / (kN * kC * 4));
    if (m % batch != 0) continue;  // K equal slices
    const uint64_t h_bytes = m * kN * 4, y_bytes = m * kC * 4;
    const int reps = x_bytes <= (1 << 20)    ? 200
                     : x_bytes <= (16 << 20) ? 20
                                             : 5;
    auto x = mhc::client::RandomTensor(DType::kF32, {m, kN, kC}, 1);
    auto h = mhc::client::RandomTensor(DType::kF32, {m, kN}, 2);

    auto object = mhc::client::SharedMemoryObject::Create(
        mhc::client::UniqueShmKey("mhcd_bench_", "agg"),
        x_bytes + h_bytes + y_bytes);
    if (!object.ok()) return Fail(object.status());
    std::memcpy((*object)->data(), x.bytes.data(), x_bytes);
    std::memcpy((*object)->data() + x_bytes, h.bytes.data(), h_bytes);
    absl::Status registered = (*client)->RegisterSystemSharedMemory(
        "agg", (*object)->key(), 0, (*object)->size());
    if (!registered.ok()) return Fail(registered);
    if (!header) {
      auto status = (*client)->SharedMemoryStatus("agg");
      if (!status.ok()) return Fail(status.status());
      const bool pinned = status->regions(0).pinned();
      std::printf(
          "%s, %d op(s) per request, shared memory %s\n\n"
          "| x | inline ms | shared memory ms | speedup | inline GB/s (x) | "
          "shared memory GB/s (x) |\n"
          "|---|---|---|---|---|---|\n",
          description.c_str(), batch,
          host     ? "read and written in place"
          : pinned ? "page-locked for the device copies"
                   : "copied pageable (not page-locked)");
      header = true;
    }
    const mhc::v1::ExecuteRequest inline_request =
        MakeBatch(batch, m, x, h, /*shm=*/false);
    const mhc::v1::ExecuteRequest shm_request =
        MakeBatch(batch, m, x, h, /*shm=*/true);

    std::vector<double> inline_ms, shm_ms;
    for (int rep = 0; rep <= reps; ++rep) {
      std::memset((*object)->data() + x_bytes + h_bytes, 0xFF, y_bytes);
      absl::Time start = absl::Now();
      auto a = (*client)->Execute(inline_request);
      if (!a.ok()) return Fail(a.status());
      const double t_inline = absl::ToDoubleMilliseconds(absl::Now() - start);
      start = absl::Now();
      auto b = (*client)->Execute(shm_request);
      if (!b.ok()) return Fail(b.status());
      const double t_shm = absl::ToDoubleMilliseconds(absl::Now() - start);
      if (rep == 0) {
        // Warm-up, and the check that both paths computed the same y.
        const uint64_t y_part = y_bytes / batch;
        for (int k = 0; k < batch; ++k) {
          const std::string& y =
              a->outputs().at(absl::StrCat("agg", k, ".y")).inline_data();
          if (y.size() != y_part ||
              std::memcmp(y.data(),
                          (*object)->data() + x_bytes + h_bytes + k * y_part,
                          y_part) != 0) {
            return Fail(absl::InternalError("inline and shm results differ"));
          }
        }
        continue;
      }
      inline_ms.push_back(t_inline);
      shm_ms.push_back(t_shm);
    }
    auto unregistered = (*client)->UnregisterSharedMemory("agg");
    if (!unregistered.ok()) return Fail(unregistered.status());
    const double mi = Median(inline_ms), ms = Median(shm_ms);
    std::printf("| %s | %.3f | %.3f | %.1fx | %.2f | %.2f |\n",
                Size(x_bytes).c_str(), mi, ms, mi / ms, x_bytes / (mi * 1e6),
                x_bytes / (ms * 1e6));
    std::fflush(stdout);
  }
  (void)(*session)->Close();
  (*server)->Drain(absl::Seconds(5));
  unlink(socket.c_str());
  return 0;
}
