// mhc_client._native: the Python client's compute calls done in C++ (see
// mhc_client/native.py). Python hands over only strs, ints and small tuples
// naming tensors in registered regions; the request is built here, sent
// through mhc::client::Client with the GIL released, and its answer checked
// here. Needs no CUDA: the stream-order events travel as indices. Built
// for CPython's stable ABI (3.10 on), so one build loads in any later
// interpreter.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cuda_driver.h"
#include "cuda_regions.h"
#include "google/protobuf/arena.h"
#include "mhc/client/call_ring.h"
#include "mhc/client/client.h"
#include "mhc/client/compute_method.h"
#include "request.h"

namespace mhc::client::python {
namespace {

// Requests and answers of the hot path are a few hundred bytes: a block on
// the stack keeps both off the heap.
constexpr size_t kArenaBlockBytes = 4096;
constexpr Py_ssize_t kComputeArgs = 10;
constexpr Py_ssize_t kComputeCudaArgs = 14;

PyObject* rpc_error = nullptr;  // mhc_client._native.RpcError

struct Stats {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> failures{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> largest_request_bytes{0};
  std::atomic<uint64_t> deferred_calls{0};
};

struct ConnectionState {
  // Copied by each call, so close() never frees a client in use.
  std::shared_ptr<Client> client;
  // The session's call ring, when one is open (see open_call_ring).
  std::shared_ptr<CallRing> ring;
  // The ring's done word as devices address it, once deferred calls are
  // enabled (enable_deferred_calls); 0 before.
  uint64_t done_word_device = 0;
  Stats stats;
};

struct ConnectionObject {
  PyObject_HEAD ConnectionState* state;
};

ConnectionState* StateOf(PyObject* self) {
  return reinterpret_cast<ConnectionObject*>(self)->state;
}

// Raises RpcError(code, message): native.py turns it into the same
// mhc_client.errors exception as the pure-Python path.
PyObject* Raise(const absl::Status& status) {
  const std::string message(status.message());
  PyObject* text = PyUnicode_DecodeUTF8(
      message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
  if (text == nullptr) return nullptr;
  PyObject* value =
      Py_BuildValue("(iN)", static_cast<int>(status.code()), text);
  if (value != nullptr) {
    PyErr_SetObject(rpc_error, value);
    Py_DECREF(value);
  }
  return nullptr;
}

void NoteLargest(std::atomic<uint64_t>& largest, uint64_t bytes) {
  uint64_t seen = largest.load(std::memory_order_relaxed);
  while (bytes > seen && !largest.compare_exchange_weak(
                             seen, bytes, std::memory_order_relaxed)) {
  }
}

// UNAVAILABLE means the request never reached a handler, so calls that are
// safe to repeat are tried `attempts` times, with the pure path's backoff.
absl::Status CallWithRetries(const Client& client, const ComputeMethod& method,
                             const google::protobuf::Message& request,
                             google::protobuf::Message& response,
                             const CallOptions& options, int attempts,
                             Stats& stats) {
  absl::Duration backoff = absl::Milliseconds(50);
  for (int attempt = 1;; ++attempt) {
    absl::Status status = client.Compute(method, request, response, options);
    if (status.code() != absl::StatusCode::kUnavailable ||
        attempt >= attempts) {
      return status;
    }
    stats.retries.fetch_add(1, std::memory_order_relaxed);
    absl::SleepFor(backoff);
    backoff *= 4;
  }
}

int ConnectionInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"target", "max_message_bytes",
                                   "bearer_token", nullptr};
  const char* target = nullptr;
  int max_message_bytes = 1 << 30;
  const char* bearer_token = "";
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|is",
                                   const_cast<char**>(keywords), &target,
                                   &max_message_bytes, &bearer_token)) {
    return -1;
  }
  ClientOptions options;
  options.max_message_bytes = max_message_bytes;
  options.bearer_token = bearer_token;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(target, options);
  if (!client.ok()) {
    Raise(client.status());
    return -1;
  }
  ConnectionState*& state = reinterpret_cast<ConnectionObject*>(self)->state;
  delete state;
  state = new ConnectionState;
  state->client = std::shared_ptr<Client>(*std::move(client));
  return 0;
}

void ConnectionDealloc(PyObject* self) {
  delete StateOf(self);
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free))(self);
  Py_DECREF(type);  // instances of heap types own a reference to it
}

// The arguments compute() and compute_cuda() share, from args[0..9].
struct CallArgs {
  const ComputeMethod* method = nullptr;
  CallOptions options;
  int attempts = 1;
};

bool ParseCallArgs(PyObject* const* args, CallArgs& call) {
  const long index = PyLong_AsLong(args[0]);
  const absl::Span<const ComputeMethod> methods = ComputeMethod::All();
  if (index < 0 || static_cast<size_t>(index) >= methods.size()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "compute(): no such method index");
    return false;
  }
  call.method = &methods[static_cast<size_t>(index)];
  Py_ssize_t session_size = 0;
  const char* session = PyUnicode_AsUTF8AndSize(args[5], &session_size);
  const long wait_event = PyLong_AsLong(args[6]);
  const long signal_event = PyLong_AsLong(args[7]);
  const double timeout_s = PyFloat_AsDouble(args[8]);
  call.attempts = static_cast<int>(PyLong_AsLong(args[9]));
  if (PyErr_Occurred()) return false;
  call.options.stream_order = {static_cast<int>(wait_event),
                               static_cast<int>(signal_event)};
  call.options.timeout = absl::Seconds(timeout_s);
  // The session id's bytes belong to a str the caller holds for the call.
  call.options.session_id =
      absl::string_view(session, static_cast<size_t>(session_size));
  return true;
}

// A request and its answer on the stack (one arena block).
struct CallMessages {
  explicit CallMessages(const ComputeMethod& method)
      : arena(Options(block)),
        request(method.NewRequest(&arena)),
        response(method.NewResponse(&arena)) {}
  static google::protobuf::ArenaOptions Options(char* block) {
    google::protobuf::ArenaOptions options;
    options.initial_block = block;
    options.initial_block_size = kArenaBlockBytes;
    return options;
  }
  alignas(std::max_align_t) char block[kArenaBlockBytes];
  google::protobuf::Arena arena;
  google::protobuf::Message* request;
  google::protobuf::Message* response;
};

// Sends the request without the GIL and checks that the outputs came back
// in place.
absl::Status Send(ConnectionState& state, const CallArgs& call,
                  CallMessages& messages) {
  std::shared_ptr<Client> client = state.client;
  Stats& stats = state.stats;
  absl::Status status;
  Py_BEGIN_ALLOW_THREADS;
  stats.calls.fetch_add(1, std::memory_order_relaxed);
  NoteLargest(stats.largest_request_bytes, messages.request->ByteSizeLong());
  status =
      CallWithRetries(*client, *call.method, *messages.request,
                      *messages.response, call.options, call.attempts, stats);
  if (status.ok()) {
    status = CheckOutputsInPlace(*call.method, *messages.request,
                                 *messages.response);
  }
  if (!status.ok()) stats.failures.fetch_add(1, std::memory_order_relaxed);
  Py_END_ALLOW_THREADS;
  return status;
}

// Posts the request as a deferred call of the session's ring: the wait
// event is recorded on `stream` when the ring is ready for it, and `stream`
// then waits on the ring's done word. `*sent` false (and OK) when the ring
// is closed: nothing was done.
absl::Status Post(ConnectionState& state, const CallArgs& call,
                  CallMessages& messages, CudaStreamHandle stream,
                  CudaEventHandle wait, bool* sent) {
  *sent = false;
  std::shared_ptr<CallRing> ring = state.ring;
  if (ring == nullptr || !ring->usable()) return absl::OkStatus();
  Stats& stats = state.stats;
  absl::Status status;
  uint32_t seq = 0;
  const absl::Duration timeout =
      call.options.timeout.value_or(state.client->timeout());
  Py_BEGIN_ALLOW_THREADS;
  NoteLargest(stats.largest_request_bytes, messages.request->ByteSizeLong());
  status = ring->Post(
      call.method->name(), *messages.request, call.options.stream_order,
      [&] { return RecordEvent(wait, stream); }, timeout, &seq, sent);
  if (status.ok()) status = WaitWord(stream, state.done_word_device, seq);
  Py_END_ALLOW_THREADS;
  if (*sent) {
    stats.calls.fetch_add(1, std::memory_order_relaxed);
    stats.deferred_calls.fetch_add(1, std::memory_order_relaxed);
  }
  if (!status.ok()) {
    stats.failures.fetch_add(1, std::memory_order_relaxed);
    *sent = true;  // an earlier call's error, or this one's: not retried
  }
  return status;
}

ConnectionState* OpenState(PyObject* self) {
  ConnectionState* state = StateOf(self);
  if (state == nullptr || state->client == nullptr) {
    Raise(absl::FailedPreconditionError("the native connection is closed"));
    return nullptr;
  }
  return state;
}

bool CheckArgCount(const char* name, Py_ssize_t expected, Py_ssize_t nargs) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", name,
               expected, nargs);
  return false;
}

// compute(method, layer, tensors, outputs, flags, session_id, wait_event,
//         signal_event, timeout_s, attempts): see request.h for the tuples.
PyObject* Compute(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  CallArgs call;
  if (!CheckArgCount("compute", kComputeArgs, nargs)) return nullptr;
  ConnectionState* state = OpenState(self);
  if (state == nullptr || !ParseCallArgs(args, call)) return nullptr;
  CallMessages messages(*call.method);
  absl::Status status = FillRequest(*call.method, args[1], args[2], args[3],
                                    args[4], *messages.request);
  if (status.ok()) status = Send(*state, call, messages);
  if (!status.ok()) return Raise(status);
  Py_RETURN_NONE;
}

// compute_cuda(method, layer, tensors, outputs, flags, session_id,
//              wait_event, signal_event, timeout_s, attempts, table, stream,
//              wait_handle, signal_handle): a call on CUDA tensors named by
// address (request.h, FillCudaRequest), ordered with `stream`: the event
// `wait_handle` (this process's event wait_event) is recorded on it before
// the request goes, and it waits on `signal_handle` (the daemon's
// signal_event) after the answer. False, and nothing done, when an
// allocation is not in `table`.
PyObject* ComputeCuda(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  CallArgs call;
  if (!CheckArgCount("compute_cuda", kComputeCudaArgs, nargs)) return nullptr;
  ConnectionState* state = OpenState(self);
  if (state == nullptr || !ParseCallArgs(args, call)) return nullptr;
  CudaRegionTable* table = CudaRegionTableOf(args[10]);
  if (table == nullptr) return nullptr;
  const auto stream = static_cast<CudaStreamHandle>(PyLong_AsSize_t(args[11]));
  const auto wait = static_cast<CudaEventHandle>(PyLong_AsSize_t(args[12]));
  const auto signal = static_cast<CudaEventHandle>(PyLong_AsSize_t(args[13]));
  if (PyErr_Occurred()) return nullptr;
  CallMessages messages(*call.method);
  CudaRegionTable::Hold hold(*table);
  bool placed = false;
  absl::Status status =
      FillCudaRequest(*call.method, args[1], args[2], args[3], args[4], *table,
                      hold, placed, *messages.request);
  if (!status.ok()) return Raise(status);
  if (!placed) Py_RETURN_FALSE;
  if (state->done_word_device != 0 &&
      call.options.stream_order.signal_event < 0) {
    bool sent = false;
    status = Post(*state, call, messages, stream, wait, &sent);
    if (!status.ok()) return Raise(status);
    if (sent) Py_RETURN_TRUE;
    // The ring closed: the call goes over gRPC, answered once done.
  }
  status = RecordEvent(wait, stream);
  if (status.ok()) status = Send(*state, call, messages);
  if (status.ok() && signal != 0) status = WaitEvent(stream, signal);
  if (!status.ok()) return Raise(status);
  Py_RETURN_TRUE;
}

// enable_deferred_calls(): compute_cuda() calls without a signal event go
// through the open ring as deferred calls (mhc/client/call_ring.h), the
// stream waiting on the ring's done word. Needs the thread's CUDA context
// current. True when enabled; False, with nothing changed, without a ring
// or a driver that can wait on host memory.
PyObject* EnableDeferred(PyObject* self, PyObject*) {
  ConnectionState* state = OpenState(self);
  if (state == nullptr) return nullptr;
  if (state->done_word_device != 0) Py_RETURN_TRUE;
  if (state->ring == nullptr || !state->ring->usable()) Py_RETURN_FALSE;
  absl::StatusOr<uint64_t> word =
      PinHostPage(state->ring->ring_page(), CallRing::kRingPageBytes,
                  state->ring->done_word());
  if (!word.ok()) Py_RETURN_FALSE;
  state->done_word_device = *word;
  Py_RETURN_TRUE;
}

// flush(): collects the answer of the last deferred call; raises its error.
PyObject* Flush(PyObject* self, PyObject*) {
  ConnectionState* state = OpenState(self);
  if (state == nullptr) return nullptr;
  std::shared_ptr<CallRing> ring = state->ring;
  if (ring == nullptr) Py_RETURN_NONE;
  absl::Status status;
  Py_BEGIN_ALLOW_THREADS;
  status = ring->Flush(state->client->timeout());
  Py_END_ALLOW_THREADS;
  if (!status.ok()) return Raise(status);
  Py_RETURN_NONE;
}

// open_call_ring(session_id, key_prefix, area_bytes): makes a ring of the
// session the way of this connection's compute calls (mhc/client/call_ring.h).
PyObject* OpenRing(PyObject* self, PyObject* args) {
  const char* session_id = nullptr;
  const char* key_prefix = nullptr;
  unsigned long long area_bytes = 0;
  if (!PyArg_ParseTuple(args, "ssK", &session_id, &key_prefix, &area_bytes)) {
    return nullptr;
  }
  ConnectionState* state = StateOf(self);
  if (state == nullptr || state->client == nullptr) {
    return Raise(
        absl::FailedPreconditionError("the native connection is closed"));
  }
  std::shared_ptr<Client> client = state->client;
  absl::StatusOr<std::shared_ptr<CallRing>> ring;
  Py_BEGIN_ALLOW_THREADS;
  client->set_session_id(session_id);
  ring = CallRing::Open(*client, area_bytes, key_prefix);
  Py_END_ALLOW_THREADS;
  if (!ring.ok()) return Raise(ring.status());
  state->ring = *ring;
  client->set_call_ring(*std::move(ring));
  Py_RETURN_NONE;
}

// Later calls go over gRPC; the daemon drops the ring with the session.
// With deferred calls, waits for the device first: streams may still wait
// on the ring's done word, whose page is then unlocked.
PyObject* CloseRing(PyObject* self, PyObject*) {
  ConnectionState* state = StateOf(self);
  if (state == nullptr) Py_RETURN_NONE;
  if (state->client != nullptr) state->client->set_call_ring(nullptr);
  std::shared_ptr<CallRing> ring = std::move(state->ring);
  if (ring != nullptr && state->done_word_device != 0) {
    Py_BEGIN_ALLOW_THREADS;
    // Errors here belong to calls whose callers have gone; the memory must
    // be released all the same.
    ring->Flush(absl::Seconds(30)).IgnoreError();
    SynchronizeContext().IgnoreError();
    UnpinHostPage(ring->ring_page()).IgnoreError();
    Py_END_ALLOW_THREADS;
  }
  state->done_word_device = 0;
  Py_RETURN_NONE;
}

PyObject* StatsDict(PyObject* self, PyObject*) {
  if (StateOf(self) == nullptr) return PyDict_New();
  const Stats& s = StateOf(self)->stats;
  const std::shared_ptr<CallRing>& ring = StateOf(self)->ring;
  return Py_BuildValue(
      "{sKsKsKsKsKsKsd}", "calls",
      static_cast<unsigned long long>(s.calls.load()), "deferred_calls",
      static_cast<unsigned long long>(s.deferred_calls.load()), "failures",
      static_cast<unsigned long long>(s.failures.load()), "retries",
      static_cast<unsigned long long>(s.retries.load()),
      "largest_request_bytes",
      static_cast<unsigned long long>(s.largest_request_bytes.load()),
      "ring_calls",
      static_cast<unsigned long long>(ring != nullptr ? ring->calls() : 0),
      "deferred_wait_s",
      ring != nullptr ? absl::ToDoubleSeconds(ring->deferred_wait()) : 0.0);
}

PyObject* ResetStats(PyObject* self, PyObject*) {
  if (StateOf(self) != nullptr) {
    Stats& s = StateOf(self)->stats;
    s.calls = 0;
    s.failures = 0;
    s.retries = 0;
    s.largest_request_bytes = 0;
    s.deferred_calls = 0;
  }
  Py_RETURN_NONE;
}

// Later calls fail; calls in flight finish on their copy of the client.
PyObject* Close(PyObject* self, PyObject*) {
  CloseRing(self, nullptr);
  if (StateOf(self) != nullptr) StateOf(self)->client.reset();
  Py_RETURN_NONE;
}

PyMethodDef connection_methods[] = {
    {"compute",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Compute)),
     METH_FASTCALL,
     "compute(method, layer, tensors, outputs, flags, session_id, "
     "wait_event, signal_event, timeout_s, attempts): one compute call"},
    {"compute_cuda",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ComputeCuda)),
     METH_FASTCALL,
     "compute_cuda(method, layer, tensors, outputs, flags, session_id, "
     "wait_event, signal_event, timeout_s, attempts, table, stream, "
     "wait_handle, signal_handle): one stream-ordered call on CUDA tensors "
     "named by address; False when an allocation is not in table"},
    {"enable_deferred_calls", EnableDeferred, METH_NOARGS,
     "compute_cuda() calls without a signal event become deferred calls "
     "of the open ring; False when that cannot be"},
    {"flush", Flush, METH_NOARGS,
     "collects the last deferred call's answer; raises its error"},
    {"open_call_ring", OpenRing, METH_VARARGS,
     "open_call_ring(session_id, key_prefix, area_bytes): compute calls of "
     "that session go through a shared-memory call ring"},
    {"close_call_ring", CloseRing, METH_NOARGS,
     "compute calls go over gRPC again"},
    {"stats", StatsDict, METH_NOARGS,
     "calls, failures, retries, largest_request_bytes and ring_calls (of the "
     "open ring) so far"},
    {"reset_stats", ResetStats, METH_NOARGS, "zeroes the stats"},
    {"close", Close, METH_NOARGS, "drops the channel (later calls fail)"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot connection_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("Connection(target, max_message_bytes=1 << 30): a C++ "
                       "channel to mhcd")},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void*>(ConnectionInit)},
    {Py_tp_dealloc, reinterpret_cast<void*>(ConnectionDealloc)},
    {Py_tp_methods, connection_methods},
    {0, nullptr}};

PyType_Spec connection_spec = {"mhc_client._native.Connection",
                               sizeof(ConnectionObject), 0, Py_TPFLAGS_DEFAULT,
                               connection_slots};

// The compute RPCs' names, in the order compute() indexes them.
PyObject* Methods(PyObject*, PyObject*) {
  const absl::Span<const ComputeMethod> methods = ComputeMethod::All();
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(methods.size()));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < methods.size(); ++i) {
    const absl::string_view name = methods[i].name();
    PyObject* text = PyUnicode_FromStringAndSize(
        name.data(), static_cast<Py_ssize_t>(name.size()));
    if (text == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SetItem(names, static_cast<Py_ssize_t>(i), text);  // steals
  }
  return names;
}

PyMethodDef module_methods[] = {
    {"methods", Methods, METH_NOARGS,
     "the compute RPCs' names, in the order compute() indexes them"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "mhc_client._native",
    "The Python client's compute calls in C++ (see mhc_client.native).",
    -1,
    module_methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

}  // namespace
}  // namespace mhc::client::python

PyMODINIT_FUNC PyInit__native() {
  using namespace mhc::client::python;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyObject* connection_type = PyType_FromSpec(&connection_spec);
  if (connection_type == nullptr ||
      PyModule_AddObject(module, "Connection", connection_type) < 0) {
    Py_XDECREF(connection_type);
    Py_DECREF(module);
    return nullptr;
  }
  rpc_error =
      PyErr_NewException("mhc_client._native.RpcError", nullptr, nullptr);
  if (rpc_error == nullptr ||
      PyModule_AddObject(module, "RpcError", rpc_error) < 0) {
    Py_XDECREF(rpc_error);
    Py_DECREF(module);
    return nullptr;
  }
  Py_INCREF(rpc_error);  // the module's reference was stolen; keep ours
  PyObject* table_type = NewCudaRegionTableType();
  if (table_type == nullptr ||
      PyModule_AddObject(module, "CudaRegionTable", table_type) < 0) {
    Py_XDECREF(table_type);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
