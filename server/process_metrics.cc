#include "server/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "prometheus/metric_family.h"

namespace mhc::server {

namespace {

prometheus::MetricFamily Family(const char* name, const char* help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(metric);
  return family;
}

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

// Fields of /proc/self/stat after the command name, which may itself hold
// spaces and parentheses; field 3 of proc(5) (state) comes first.
std::vector<std::string> StatFields() {
  const std::string stat = ReadFile("/proc/self/stat");
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return {};
  return absl::StrSplit(stat.substr(close + 2), ' ', absl::SkipEmpty());
}

// Field `number` of proc(5)'s numbering (1-based, pid is 1).
double StatField(const std::vector<std::string>& fields, size_t number) {
  double value = 0;
  if (number < 3 || number - 3 >= fields.size()) return 0;
  if (!absl::SimpleAtod(fields[number - 3], &value)) return 0;
  return value;
}

double BootTimeSeconds() {
  std::istringstream in(ReadFile("/proc/stat"));
  std::string key;
  double value = 0;
  while (in >> key) {
    if (key == "btime" && in >> value) return value;
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

double OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  double count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the directory stream's own descriptor
}

class ProcessCollector : public prometheus::Collectable {
 public:
  ProcessCollector()
      : ticks_(static_cast<double>(sysconf(_SC_CLK_TCK))),
        page_(static_cast<double>(sysconf(_SC_PAGESIZE))),
        start_time_(BootTimeSeconds() + StatField(StatFields(), 22) / ticks_) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const std::vector<std::string> stat = StatFields();
    std::vector<prometheus::MetricFamily> families;
    families.push_back(
        Family("process_cpu_seconds_total",
               "Total user and system CPU time spent.", MetricType::Counter,
               (StatField(stat, 14) + StatField(stat, 15)) / ticks_));
    families.push_back(Family("process_resident_memory_bytes",
                              "Resident memory size.", MetricType::Gauge,
                              StatField(stat, 24) * page_));
    families.push_back(Family("process_virtual_memory_bytes",
                              "Virtual memory size.", MetricType::Gauge,
                              StatField(stat, 23)));
    families.push_back(Family("process_open_fds",
                              "Number of open file descriptors.",
                              MetricType::Gauge, OpenFds()));
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
      families.push_back(
          Family("process_max_fds", "Maximum number of open file descriptors.",
                 MetricType::Gauge, static_cast<double>(limit.rlim_cur)));
    }
    families.push_back(
        Family("process_start_time_seconds",
               "Start time of the process since unix epoch in seconds.",
               MetricType::Gauge, start_time_));
    return families;
  }

 private:
  const double ticks_;
  const double page_;
  const double start_time_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeProcessCollector() {
  return std::make_shared<ProcessCollector>();
}

}  // namespace mhc::server
