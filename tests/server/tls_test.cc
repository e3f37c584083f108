// TLS and mutual TLS on TCP listeners, with certificates made by openssl at
// test time: a CA, the daemon's certificate (localhost, 127.0.0.1), a
// client certificate, and a client certificate of another CA.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "auth_test_util.h"
#include "server_test_util.h"

namespace mhc::testing {
namespace {

constexpr char kMakeCertificates[] = R"(set -e
cd "$1"
key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "$@"; }
key -x509 -days 2 -subj /CN=mhcd-test-ca -keyout ca.key -out ca.pem
key -x509 -days 2 -subj /CN=other-ca -keyout other-ca.key -out other-ca.pem
key -subj /CN=localhost -keyout server.key -out server.csr
echo 'subjectAltName=DNS:localhost,IP:127.0.0.1' > server.ext
openssl x509 -req -days 2 -in server.csr -CA ca.pem -CAkey ca.key \
  -CAcreateserial -extfile server.ext -out server.pem
echo 'extendedKeyUsage=clientAuth' > client.ext
key -subj /CN=trainer -keyout client.key -out client.csr
openssl x509 -req -days 2 -in client.csr -CA ca.pem -CAkey ca.key \
  -CAcreateserial -extfile client.ext -out client.pem
key -subj /CN=intruder -keyout intruder.key -out intruder.csr
openssl x509 -req -days 2 -in intruder.csr -CA other-ca.pem \
  -CAkey other-ca.key -CAcreateserial -extfile client.ext -out intruder.pem
)";

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto found = RunCommand({"/bin/sh", "-c", "command -v openssl"});
    if (!found.ok() || found->first != 0) {
      GTEST_SKIP() << "openssl is not installed";
    }
    const std::string script = dir_.Write("make.sh", kMakeCertificates, 0700);
    auto made =
        RunCommand({"/bin/sh", "-c",
                    absl::StrCat("sh ", script, " ", dir_.path(), " 2>&1")});
    ASSERT_TRUE(made.ok()) << made.status();
    ASSERT_EQ(made->first, 0) << made->second;
  }

  std::string File(const std::string& name) const {
    return absl::StrCat(dir_.path(), "/", name);
  }
  std::string Pem(const std::string& name) const {
    auto text = client::ReadClientFile(File(name));
    return text.ok() ? *text : "";
  }

  // Starts the daemon on TLS TCP plus `flags`; sets address_.
  void StartDaemon(std::vector<std::string> flags) {
    flags.insert(flags.end(),
                 {"--listen=127.0.0.1:0", "--tls_cert=" + File("server.pem"),
                  "--tls_key=" + File("server.key")});
    MHC_ASSERT_OK_AND_ASSIGN(daemon_, Daemon::Start(flags));
    for (absl::string_view line : absl::StrSplit(daemon_->Stdout(), '\n')) {
      if (absl::ConsumePrefix(&line, "mhcd: listening on ")) {
        address_ = std::string(line);
      }
    }
    ASSERT_FALSE(address_.empty()) << daemon_->Stdout();
  }

  absl::Status Info(client::ClientOptions options) {
    options.timeout = absl::Seconds(10);
    auto client = client::Client::Connect(address_, options);
    if (!client.ok()) return client.status();
    return (*client)->GetServerInfo().status();
  }

  client::ClientOptions Trusting() const {
    client::ClientOptions options;
    options.tls = true;
    options.tls_root_ca_pem = Pem("ca.pem");
    return options;
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  std::string address_;
};

TEST_F(TlsTest, ClientsThatTrustTheCaConnectAndPlaintextDoesNot) {
  StartDaemon({});
  {
    const absl::Status s = Info(Trusting());
    EXPECT_TRUE(s.ok()) << s;
  }
  client::ClientOptions by_name = Trusting();
  by_name.tls_server_name = "localhost";
  {
    const absl::Status s = Info(by_name);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_FALSE(Info(client::ClientOptions()).ok());
  client::ClientOptions other_ca;
  other_ca.tls = true;
  other_ca.tls_root_ca_pem = Pem("other-ca.pem");
  EXPECT_FALSE(Info(other_ca).ok());
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateOfTheCa) {
  StartDaemon({"--tls_client_ca=" + File("ca.pem")});
  client::ClientOptions trainer = Trusting();
  trainer.tls_client_cert_pem = Pem("client.pem");
  trainer.tls_client_key_pem = Pem("client.key");
  {
    const absl::Status s = Info(trainer);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_FALSE(Info(Trusting()).ok());
  client::ClientOptions intruder = Trusting();
  intruder.tls_client_cert_pem = Pem("intruder.pem");
  intruder.tls_client_key_pem = Pem("intruder.key");
  EXPECT_FALSE(Info(intruder).ok());
}

TEST_F(TlsTest, TokensRideOnTlsAndMhcctlSpeaksBoth) {
  StartDaemon({"--auth_tokens=" + WriteTokensFile(dir_)});
  client::ClientOptions reader = Trusting();
  reader.bearer_token = kReadToken;
  {
    const absl::Status s = Info(reader);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(Info(Trusting()).code(), absl::StatusCode::kUnauthenticated);

  const std::string token_file =
      dir_.Write("token", absl::StrCat(kReadToken, "\n"), 0600);
  auto info = RunCommand(
      {MHC_MHCCTL_PATH, "--address=" + address_, "--tls_ca=" + File("ca.pem"),
       "--tls_server_name=localhost", "--token_file=" + token_file, "info"});
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->first, 0) << info->second;
  auto create =
      RunCommand({MHC_MHCCTL_PATH, "--address=" + address_,
                  "--tls_ca=" + File("ca.pem"), "--token_file=" + token_file,
                  "layer", "create", "--name=l", "--hidden=64"});
  ASSERT_TRUE(create.ok()) << create.status();
  EXPECT_NE(create->first, 0) << create->second;
}

TEST_F(TlsTest, TlsListenersMayFaceTheNetwork) {
  MHC_ASSERT_OK_AND_ASSIGN(
      auto daemon,
      Daemon::Start({"--listen=0.0.0.0:0", "--tls_cert=" + File("server.pem"),
                     "--tls_key=" + File("server.key")}));
  EXPECT_TRUE(absl::StrContains(daemon->Stdout(), "listening on 0.0.0.0:"));
}

}  // namespace
}  // namespace mhc::testing
