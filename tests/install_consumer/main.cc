// Talks to a running mhcd through the installed client library: server info,
// then a layer created, listed and deleted. Exit 0 when every call worked.
//
//   mhc_install_consumer ADDRESS
#include <iostream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "mhc/client/client.h"

namespace {

int Fail(const std::string& what, const absl::Status& status) {
  std::cerr << "mhc_install_consumer: " << what << ": " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: mhc_install_consumer ADDRESS\n";
    return 2;
  }
  auto client = mhc::client::Client::Connect(argv[1]);
  if (!client.ok()) return Fail("connect", client.status());
  if (absl::Status ready = (*client)->WaitForReady(absl::Seconds(30));
      !ready.ok()) {
    return Fail("wait for ready", ready);
  }
  auto info = (*client)->GetServerInfo();
  if (!info.ok()) return Fail("GetServerInfo", info.status());

  mhc::v1::CreateLayerRequest request;
  request.set_name("consumer");
  request.mutable_spec()->set_hidden(64);
  request.set_seed(1);
  auto layer = (*client)->CreateLayer(request);
  if (!layer.ok()) return Fail("CreateLayer", layer.status());
  auto layers = (*client)->ListLayers();
  if (!layers.ok()) return Fail("ListLayers", layers.status());
  if (layers->layers_size() != 1) {
    return Fail("ListLayers", absl::InternalError("expected one layer"));
  }
  auto deleted = (*client)->DeleteLayer("consumer");
  if (!deleted.ok()) return Fail("DeleteLayer", deleted.status());

  std::cout << "mhc_install_consumer: mhcd " << info->version() << " ("
            << info->backend() << "), layer '" << layer->name() << "' with "
            << layer->parameter_count() << " parameters on " << layer->device()
            << "\n";
  return 0;
}
