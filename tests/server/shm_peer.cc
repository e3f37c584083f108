// A client process of its own for the shared-memory tests, so that the
// daemon, the test and this client are three processes as in production.
//
//   shm_peer equal ADDRESS LAYER N C M
//     Runs Pre and an Execute batch (pre -> post) on layer LAYER once with
//     inline tensors and once with every input and output in shared memory;
//     exits 0 and prints "equal" when each output has the same bytes.
//   shm_peer hold ADDRESS
//     Opens a session, registers region "held" of 1 MiB, prints
//     "held <session id> <key>" and waits for stdin to close.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "mhc/client/call_ring.h"
#include "mhc/client/client.h"
#include "mhc/client/shm.h"
#include "mhc/client/tensor.h"

namespace {

using mhc::DType;
using mhc::client::Client;
using mhc::client::HostTensor;
using mhc::client::SharedMemoryObject;

int Fail(const std::string& what, const absl::Status& status) {
  std::cout << "FAIL " << what << ": " << status << std::endl;
  return 1;
}

// Places tensors one after another, 64-byte aligned, in one object.
class Arena {
 public:
  explicit Arena(SharedMemoryObject* object) : object_(object) {}
  uint64_t Put(const HostTensor& t) {
    const uint64_t offset = Reserve(t.bytes.size());
    std::memcpy(object_->data() + offset, t.bytes.data(), t.bytes.size());
    return offset;
  }
  uint64_t Reserve(uint64_t bytes) {
    const uint64_t offset = next_;
    next_ += (bytes + 63) / 64 * 64;
    return offset;
  }
  std::string Bytes(uint64_t offset, uint64_t bytes) const {
    return std::string(object_->data() + offset, bytes);
  }

 private:
  SharedMemoryObject* object_;
  uint64_t next_ = 0;
};

int Equal(Client& client, const std::string& layer, int64_t n, int64_t c,
          int64_t m) {
  const HostTensor x = mhc::client::RandomTensor(DType::kF32, {m, n, c}, 11);
  const HostTensor f = mhc::client::RandomTensor(DType::kF32, {m, c}, 12);

  // Inline reference.
  mhc::v1::PreRequest pre;
  pre.set_layer(layer);
  *pre.mutable_x() = mhc::client::ToTensorRef(x);
  auto inline_pre = client.Pre(pre);
  if (!inline_pre.ok()) return Fail("inline Pre", inline_pre.status());
  mhc::v1::ExecuteRequest batch;
  auto* op1 = batch.add_ops();
  op1->set_id("pre");
  *op1->mutable_pre() = pre;
  auto* op2 = batch.add_ops();
  op2->set_id("post");
  op2->mutable_post()->set_layer(layer);
  *op2->mutable_post()->mutable_f() = mhc::client::ToTensorRef(f);
  *op2->mutable_post()->mutable_x() = mhc::client::ToTensorRef(x);
  op2->mutable_post()->mutable_h_post()->set_ref("pre.h_post");
  op2->mutable_post()->mutable_h_res()->set_ref("pre.h_res");
  batch.add_fetch("post.x_next");
  auto inline_batch = client.Execute(batch);
  if (!inline_batch.ok()) return Fail("inline Execute", inline_batch.status());

  // The same through shared memory.
  auto session = mhc::client::Session::Open(client);
  if (!session.ok()) return Fail("OpenSession", session.status());
  const uint64_t total = 2 * x.bytes.size() + f.bytes.size() + m * c * 4 +
                         3 * m * n * 4 + m * n * n * 4 + 4096;
  auto object = SharedMemoryObject::Create(
      mhc::client::UniqueShmKey("mhcd_peer_", "equal"), total);
  if (!object.ok()) return Fail("create object", object.status());
  Arena arena(object->get());
  const uint64_t x_at = arena.Put(x);
  const uint64_t f_at = arena.Put(f);
  std::map<std::string, std::pair<uint64_t, uint64_t>> outs = {
      {"y", {0, m * c * 4}},          {"h_pre", {0, m * n * 4}},
      {"h_post", {0, m * n * 4}},     {"h_res", {0, m * n * n * 4}},
      {"x_next", {0, m * n * c * 4}},
  };
  for (auto& [name, place] : outs) place.first = arena.Reserve(place.second);
  absl::Status registered = client.RegisterSystemSharedMemory(
      "peer", (*object)->key(), 0, (*object)->size());
  if (!registered.ok()) return Fail("register", registered);

  mhc::v1::PreRequest shm_pre;
  shm_pre.set_layer(layer);
  *shm_pre.mutable_x() =
      mhc::client::ShmTensorRef(DType::kF32, {m, n, c}, "peer", x_at);
  for (const char* name : {"y", "h_pre", "h_post", "h_res"}) {
    (*shm_pre.mutable_output_regions())[name] =
        mhc::client::ShmRef("peer", outs[name].first, outs[name].second);
  }
  auto shm_out = client.Pre(shm_pre);
  if (!shm_out.ok()) return Fail("shm Pre", shm_out.status());
  if (!shm_out->y().inline_data().empty() || !shm_out->y().has_shm()) {
    std::cout << "FAIL shm Pre returned inline bytes" << std::endl;
    return 1;
  }
  const std::map<std::string, const mhc::v1::TensorRef*> inline_outs = {
      {"y", &inline_pre->y()},
      {"h_pre", &inline_pre->h_pre()},
      {"h_post", &inline_pre->h_post()},
      {"h_res", &inline_pre->h_res()},
  };
  for (const auto& [name, ref] : inline_outs) {
    if (arena.Bytes(outs[name].first, outs[name].second) !=
        ref->inline_data()) {
      std::cout << "FAIL Pre output " << name << " differs" << std::endl;
      return 1;
    }
  }

  mhc::v1::ExecuteRequest shm_batch = batch;
  *shm_batch.mutable_ops(0)->mutable_pre()->mutable_x() =
      mhc::client::ShmTensorRef(DType::kF32, {m, n, c}, "peer", x_at);
  auto* post = shm_batch.mutable_ops(1)->mutable_post();
  *post->mutable_f() =
      mhc::client::ShmTensorRef(DType::kF32, {m, c}, "peer", f_at);
  *post->mutable_x() =
      mhc::client::ShmTensorRef(DType::kF32, {m, n, c}, "peer", x_at);
  (*post->mutable_output_regions())["x_next"] =
      mhc::client::ShmRef("peer", outs["x_next"].first, outs["x_next"].second);
  auto shm_batch_out = client.Execute(shm_batch);
  if (!shm_batch_out.ok()) return Fail("shm Execute", shm_batch_out.status());
  const auto& inline_next = inline_batch->outputs().at("post.x_next");
  if (arena.Bytes(outs["x_next"].first, outs["x_next"].second) !=
          inline_next.inline_data() ||
      !shm_batch_out->outputs().at("post.x_next").has_shm()) {
    std::cout << "FAIL Execute output x_next differs" << std::endl;
    return 1;
  }
  std::cout << "equal" << std::endl;
  return 0;
}

int Hold(Client& client) {
  auto session = mhc::client::Session::Open(client);
  if (!session.ok()) return Fail("OpenSession", session.status());
  auto object = SharedMemoryObject::Create(
      mhc::client::UniqueShmKey("mhcd_peer_", "held"), 1 << 20);
  if (!object.ok()) return Fail("create object", object.status());
  absl::Status registered = client.RegisterSystemSharedMemory(
      "held", (*object)->key(), 0, (*object)->size());
  if (!registered.ok()) return Fail("register", registered);
  std::cout << "held " << (*session)->id() << " " << (*object)->key()
            << std::endl;
  char buffer[64];
  while (read(STDIN_FILENO, buffer, sizeof(buffer)) > 0) {
  }
  return 0;
}

// Opens a session and a call ring, then runs Pre on layer `layer` through
// the ring until killed; prints "ringing SESSION RING_KEY X_KEY" after the
// first call (the objects only this process unlinks, so the killer can).
int Ring(Client& client, const std::string& layer, int64_t n, int64_t c) {
  auto session = mhc::client::Session::Open(client);
  if (!session.ok()) return Fail("OpenSession", session.status());
  auto ring = mhc::client::CallRing::Open(client);
  if (!ring.ok()) return Fail("OpenCallRing", ring.status());
  client.set_call_ring(*ring);
  constexpr int64_t m = 64;
  const uint64_t bytes = static_cast<uint64_t>(m * n * c) * sizeof(float);
  auto object = SharedMemoryObject::Create(
      mhc::client::UniqueShmKey("mhcd_peer_", "ring_x"), bytes);
  if (!object.ok()) return Fail("create object", object.status());
  absl::Status registered =
      client.RegisterSystemSharedMemory("x", (*object)->key(), 0, bytes);
  if (!registered.ok()) return Fail("register", registered);
  mhc::v1::PreRequest pre;
  pre.set_layer(layer);
  *pre.mutable_x() =
      mhc::client::ShmTensorRef(mhc::DType::kF32, {m, n, c}, "x", 0);
  for (uint64_t call = 0;; ++call) {
    auto answer = client.Pre(pre);
    if (!answer.ok()) return Fail("Pre", answer.status());
    if (call == 0) {
      if ((*ring)->calls() != 1) {
        std::cout << "FAIL the call did not go through the ring" << std::endl;
        return 1;
      }
      std::cout << "ringing " << (*session)->id() << " " << (*ring)->key()
                << " " << (*object)->key() << std::endl;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 2) {
    std::cerr << "usage: shm_peer equal|hold|ring ADDRESS ..." << std::endl;
    return 2;
  }
  auto client = Client::Connect(args[1]);
  if (!client.ok()) return Fail("connect", client.status());
  if (args[0] == "hold") return Hold(**client);
  int64_t n = 0, c = 0, m = 0;
  if (args[0] == "ring" && args.size() == 5 && absl::SimpleAtoi(args[3], &n) &&
      absl::SimpleAtoi(args[4], &c)) {
    return Ring(**client, args[2], n, c);
  }
  if (args[0] != "equal" || args.size() != 6 ||
      !absl::SimpleAtoi(args[3], &n) || !absl::SimpleAtoi(args[4], &c) ||
      !absl::SimpleAtoi(args[5], &m)) {
    std::cerr << "usage: shm_peer equal ADDRESS LAYER N C M" << std::endl;
    return 2;
  }
  return Equal(**client, args[2], n, c, m);
}
