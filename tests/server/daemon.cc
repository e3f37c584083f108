#include "daemon.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace mhc::testing {
namespace {

// The ready line, as text or JSON.
bool HasReadyLine(absl::string_view out) {
  return absl::StrContains(out, "mhcd: ready") ||
         absl::StrContains(out, "\"msg\":\"ready");
}

// Parses "http://host:port/metrics" out of the daemon's metrics line (text
// or JSON).
bool ParseMetricsLine(absl::string_view line, std::string* host, int* port) {
  constexpr absl::string_view kMarker = "metrics on http://";
  const size_t at = line.find(kMarker);
  if (!absl::StartsWith(line, "mhcd: ") && !absl::StartsWith(line, "{")) {
    return false;
  }
  if (at == absl::string_view::npos) return false;
  absl::string_view rest = line.substr(at + kMarker.size());
  rest = rest.substr(0, rest.find('/'));
  size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return false;
  *host = std::string(rest.substr(0, colon));
  return absl::SimpleAtoi(rest.substr(colon + 1), port);
}

pid_t Spawn(const std::vector<std::string>& argv, int stdout_fd,
            bool capture_stderr) {
  std::vector<char*> args;
  for (const std::string& arg : argv)
    args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    if (stdout_fd >= 0) dup2(stdout_fd, STDOUT_FILENO);
    if (stdout_fd >= 0 && capture_stderr) dup2(stdout_fd, STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    const std::vector<std::string>& flags, bool capture_stderr) {
  std::unique_ptr<Daemon> d(new Daemon());
  char dir[] = "/tmp/mhcd-test-XXXXXX";
  if (mkdtemp(dir) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", strerror(errno)));
  }
  d->dir_ = dir;
  d->address_ = absl::StrCat("unix:", d->dir_, "/mhcd.sock");
  // MHCD_PATH overrides the build's daemon: tests copied elsewhere (a
  // GPU bundle, scripts/bundle.sh) run the daemon copied beside them.
  const char* mhcd = std::getenv("MHCD_PATH");
  std::vector<std::string> argv = {
      mhcd != nullptr ? mhcd : MHC_MHCD_PATH, "--listen=" + d->address_,
      "--metrics_listen=127.0.0.1:0", "--backend=cpu", "--threads=2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  d->pid_ = Spawn(argv, pipe_fds[1], capture_stderr);
  close(pipe_fds[1]);
  if (d->pid_ < 0) {
    close(pipe_fds[0]);
    return absl::InternalError(absl::StrCat("fork: ", strerror(errno)));
  }
  int read_fd = pipe_fds[0];
  Daemon* raw = d.get();
  d->reader_ = std::thread([raw, read_fd] { raw->ReadLoop(read_fd); });

  absl::MutexLock lock(&d->mu_);
  auto ready_or_eof = [raw]() ABSL_SHARED_LOCKS_REQUIRED(raw->mu_) {
    return raw->eof_ || HasReadyLine(raw->stdout_);
  };
  d->mu_.AwaitWithTimeout(absl::Condition(&ready_or_eof), absl::Seconds(30));
  if (!HasReadyLine(d->stdout_)) {
    return absl::UnavailableError(
        absl::StrCat("mhcd did not become ready; stdout:\n", d->stdout_));
  }
  for (absl::string_view line : absl::StrSplit(d->stdout_, '\n')) {
    ParseMetricsLine(line, &d->metrics_host_, &d->metrics_port_);
  }
  return d;
}

void Daemon::ReadLoop(int fd) {
  char buffer[4096];
  while (true) {
    ssize_t got = read(fd, buffer, sizeof(buffer));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    absl::MutexLock lock(&mu_);
    stdout_.append(buffer, static_cast<size_t>(got));
  }
  close(fd);
  absl::MutexLock lock(&mu_);
  eof_ = true;
}

Daemon::~Daemon() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (reader_.joinable()) reader_.join();
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

absl::StatusOr<std::unique_ptr<client::Client>> Daemon::Connect(
    absl::Duration timeout) const {
  client::ClientOptions options;
  options.timeout = timeout;
  return client::Client::Connect(address_, options);
}

void Daemon::Signal(int signal) const {
  if (pid_ > 0 && !exited_) kill(pid_, signal);
}

absl::StatusOr<int> Daemon::Wait(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t got = waitpid(pid_, &status, WNOHANG);
    if (got == pid_) {
      exited_ = true;
      if (reader_.joinable()) reader_.join();
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + WTERMSIG(status);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("mhcd did not exit in time");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string Daemon::Stdout() const {
  absl::MutexLock lock(&mu_);
  return stdout_;
}

absl::StatusOr<std::string> HttpGet(const std::string& host, int port,
                                    const std::string& path,
                                    absl::Duration timeout) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket");
  if (timeout != absl::InfiniteDuration()) {
    // Bounds connect, each write and each read.
    const timeval limit = absl::ToTimeval(timeout);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    close(fd);
    return absl::InvalidArgumentError("HttpGet: host must be an IPv4 address");
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect: ", strerror(errno)));
  }
  std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host,
                                     "\r\nConnection: close\r\n\r\n");
  if (write(fd, request.data(), request.size()) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::InternalError("write");
  }
  std::string response;
  char buffer[8192];
  ssize_t got;
  while ((got = read(fd, buffer, sizeof(buffer))) > 0) {
    response.append(buffer, static_cast<size_t>(got));
  }
  const int read_error = got < 0 ? errno : 0;
  close(fd);
  if (read_error == EAGAIN || read_error == EWOULDBLOCK) {
    return absl::DeadlineExceededError(
        absl::StrCat("HttpGet ", path, ": no answer within ",
                     absl::FormatDuration(timeout)));
  }
  return response;
}

absl::StatusOr<std::pair<int, std::string>> RunCommand(
    const std::vector<std::string>& argv) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError("pipe");
  pid_t pid = Spawn(argv, pipe_fds[1], /*capture_stderr=*/false);
  close(pipe_fds[1]);
  std::string out;
  char buffer[4096];
  ssize_t got;
  while ((got = read(pipe_fds[0], buffer, sizeof(buffer))) > 0 ||
         (got < 0 && errno == EINTR)) {
    if (got > 0) out.append(buffer, static_cast<size_t>(got));
  }
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return std::make_pair(code, out);
}

absl::StatusOr<HoldingPeer> StartHoldingPeer(const std::string& peer_binary,
                                             const std::string& address) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execl(peer_binary.c_str(), peer_binary.c_str(), "hold", address.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  std::string line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  close(out[0]);
  std::vector<std::string> words = absl::StrSplit(line, ' ');
  if (pid < 0 || words.size() != 3 || words[0] != "held") {
    close(in[1]);
    if (pid > 0) waitpid(pid, nullptr, 0);
    return absl::InternalError(absl::StrCat(
        peer_binary, " hold: expected 'held SESSION KEY', got '", line, "'"));
  }
  return HoldingPeer{pid, in[1], words[1], words[2]};
}

}  // namespace mhc::testing
