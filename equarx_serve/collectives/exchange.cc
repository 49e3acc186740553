// The byte exchange of exchange.py without Python on its hot path: XLA:CPU custom calls that
// start and finish an exchange, and C++ threads that move the bytes.
//
//   handle = EquarxExchangeStart(payload u8 [n], after)       -> s32 []     (exchange's number)
//   out    = EquarxExchangeFinish(handle s32 [], after)       -> u8 [N, n]  (rank order)
//
// Start copies the payload (XLA may reuse its buffer), queues it for every peer and returns;
// one sender thread per peer writes it to that peer's TCP socket. One receiver thread per peer
// reads the peer's payloads as they come. Finish blocks the program's thread until every
// peer's payload of that exchange is in, then copies the N payloads into its result. `after`
// only orders the call (a data dependency); its value is not read. The framing is exchange.py's
// (u64 exchange number, u64 payload bytes, little-endian, then the payload), the sockets are
// the ones exchange.py connected, handed over by file descriptor (equarx_exchange_open).
//
// Cost per exchange on the program's thread: two copies of the payload (in at start, the N
// payloads out at finish), a lock and a queue push; no interpreter lock. Measured against the
// io_callback pair it replaces: see exchange.py.

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Bytes = std::vector<uint8_t>;

double Now() {  // wall clock, s: exchange.py's time.time(), so processes on one machine line up
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Times {  // one exchange's steps (exchange.py's ExchangeTimes); NaN: not (yet) happened
  double started = NAN, sent = NAN, arrived = NAN, waited = NAN, done = NAN;
};

struct Outbox {
  std::mutex mu;
  std::condition_variable ready;
  std::deque<std::pair<int64_t, std::shared_ptr<const Bytes>>> items;
  bool closed = false;
};

bool SendAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t sent = send(fd, p, n, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent;
    n -= static_cast<size_t>(sent);
  }
  return true;
}

bool ReceiveAll(int fd, void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t got = recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;  // 0: the peer closed its end
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

class Exchange {
 public:
  // fds[peer]: a connected stream socket to each other rank (fds[rank] is not read); owned.
  Exchange(int rank, int size, const int* fds) : rank_(rank), size_(size) {
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      fds_[peer] = fds[peer];
      outboxes_[peer] = std::make_unique<Outbox>();
    }
    for (auto& [peer, fd] : fds_) {
      threads_.emplace_back(&Exchange::SendLoop, this, fd, outboxes_[peer].get());
      threads_.emplace_back(&Exchange::ReceiveLoop, this, peer, fd);
    }
  }

  ~Exchange() {  // wakes and joins every thread, closes the sockets
    for (auto& [peer, fd] : fds_) shutdown(fd, SHUT_RDWR);
    for (auto& [peer, outbox] : outboxes_) {
      std::lock_guard<std::mutex> lock(outbox->mu);
      outbox->closed = true;
      outbox->ready.notify_all();
    }
    for (auto& thread : threads_) thread.join();
    for (auto& [peer, fd] : fds_) close(fd);
  }

  int64_t Start(const uint8_t* data, size_t n) {
    auto payload = std::make_shared<const Bytes>(data, data + n);
    int64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seq = next_seq_++;
      own_[seq] = payload;
      sent_bytes_ += static_cast<int64_t>(n * outboxes_.size());
      Note(seq, &Times::started);
    }
    for (auto& [peer, outbox] : outboxes_) {
      std::lock_guard<std::mutex> lock(outbox->mu);
      outbox->items.emplace_back(seq, payload);
      outbox->ready.notify_one();
    }
    return seq;
  }

  // Every rank's payload of exchange `seq` into out [size, n]; "" or why not.
  std::string Finish(int64_t seq, uint8_t* out, size_t n, double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    Note(seq, &Times::waited);
    auto complete = [&] {
      if (!failure_.empty()) return true;
      auto it = arrivals_.find(seq);
      size_t have = it == arrivals_.end() ? 0 : it->second.size();
      return have == static_cast<size_t>(size_ - 1);
    };
    if (!arrived_.wait_for(lock, std::chrono::duration<double>(timeout_s), complete)) {
      return "exchange " + std::to_string(seq) + ": no bytes from every peer in " +
             std::to_string(timeout_s) + " s";
    }
    if (!failure_.empty()) return "a peer's connection failed: " + failure_;
    std::map<int, std::shared_ptr<const Bytes>> by_rank;
    if (auto it = arrivals_.find(seq); it != arrivals_.end()) {
      by_rank = std::move(it->second);
      arrivals_.erase(it);
    }
    auto own = own_.find(seq);
    if (own == own_.end()) return "exchange " + std::to_string(seq) + " was not started here";
    by_rank[rank_] = std::move(own->second);
    own_.erase(own);
    Note(seq, &Times::done);
    lock.unlock();
    for (auto& [rank, payload] : by_rank) {
      if (payload->size() != n) {
        return "exchange " + std::to_string(seq) + ": rank " + std::to_string(rank) + " sent " +
               std::to_string(payload->size()) + " bytes, expected " + std::to_string(n);
      }
      std::memcpy(out + static_cast<size_t>(rank) * n, payload->data(), n);
    }
    return "";
  }

  int64_t sent_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_bytes_;
  }

  void Record(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    recording_ = on;
    times_.clear();
  }

  // Up to `max` rows [seq, started, sent, arrived, waited, done], by number; how many.
  int64_t CopyTimes(double* out, int64_t max) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t row = 0;
    for (auto& [seq, t] : times_) {
      if (row == max) break;
      double* r = out + 6 * row++;
      r[0] = static_cast<double>(seq);
      r[1] = t.started, r[2] = t.sent, r[3] = t.arrived, r[4] = t.waited, r[5] = t.done;
    }
    return row;
  }

 private:
  void Note(int64_t seq, double Times::*step) {  // hold mu_
    if (recording_) times_[seq].*step = Now();
  }

  void Fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = why;
    arrived_.notify_all();
  }

  void SendLoop(int fd, Outbox* outbox) {
    while (true) {
      std::pair<int64_t, std::shared_ptr<const Bytes>> item;
      {
        std::unique_lock<std::mutex> lock(outbox->mu);
        outbox->ready.wait(lock, [&] { return outbox->closed || !outbox->items.empty(); });
        if (outbox->closed) return;
        item = std::move(outbox->items.front());
        outbox->items.pop_front();
      }
      const uint64_t header[2] = {static_cast<uint64_t>(item.first), item.second->size()};
      if (!SendAll(fd, header, sizeof(header)) ||
          !SendAll(fd, item.second->data(), item.second->size())) {
        return Fail(std::string("send: ") + std::strerror(errno));
      }
      std::lock_guard<std::mutex> lock(mu_);
      Note(item.first, &Times::sent);  // the last peer's: each overwrites
    }
  }

  void ReceiveLoop(int peer, int fd) {
    while (true) {
      uint64_t header[2];
      if (!ReceiveAll(fd, header, sizeof(header))) return Fail("the peer closed its connection");
      auto payload = std::make_shared<Bytes>(header[1]);
      if (!ReceiveAll(fd, payload->data(), payload->size())) {
        return Fail("the peer closed its connection");
      }
      std::lock_guard<std::mutex> lock(mu_);
      const auto seq = static_cast<int64_t>(header[0]);
      arrivals_[seq][peer] = std::move(payload);
      Note(seq, &Times::arrived);
      arrived_.notify_all();
    }
  }

  const int rank_, size_;
  std::map<int, int> fds_;
  std::map<int, std::unique_ptr<Outbox>> outboxes_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable arrived_;
  int64_t next_seq_ = 0, sent_bytes_ = 0;
  std::map<int64_t, std::map<int, std::shared_ptr<const Bytes>>> arrivals_;
  std::map<int64_t, std::shared_ptr<const Bytes>> own_;
  std::string failure_;
  bool recording_ = false;
  std::map<int64_t, Times> times_;
};

std::mutex g_mu;
std::map<int64_t, std::unique_ptr<Exchange>> g_exchanges;
int64_t g_next_id = 0;

Exchange* Find(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_exchanges.find(id);
  return it == g_exchanges.end() ? nullptr : it->second.get();
}

ffi::Error StartCall(ffi::Buffer<ffi::U8> payload, ffi::AnyBuffer after,
                     ffi::ResultBuffer<ffi::S32> handle, int64_t exchange) {
  Exchange* ends = Find(exchange);
  if (ends == nullptr) return ffi::Error::InvalidArgument("no such exchange");
  *handle->typed_data() = static_cast<int32_t>(
      ends->Start(payload.typed_data(), static_cast<size_t>(payload.element_count())));
  return ffi::Error::Success();
}

ffi::Error FinishCall(ffi::Buffer<ffi::S32> handle, ffi::AnyBuffer after,
                      ffi::ResultBuffer<ffi::U8> out, int64_t exchange, double timeout_s) {
  Exchange* ends = Find(exchange);
  if (ends == nullptr) return ffi::Error::InvalidArgument("no such exchange");
  auto dims = out->dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("want out [N, bytes]");
  std::string why = ends->Finish(*handle.typed_data(), out->typed_data(),
                                 static_cast<size_t>(dims[1]), timeout_s);
  if (!why.empty()) return ffi::Error(ffi::ErrorCode::kUnavailable, why);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxExchangeStart, StartCall,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("exchange"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EquarxExchangeFinish, FinishCall,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("exchange")
                                  .Attr<double>("timeout_s"));

// The same exchange for exchange.py (ctypes): open one over connected sockets (owned from
// then on), start and finish outside a program, its counters and recorded times, close it.
extern "C" {

int64_t equarx_exchange_open(int32_t rank, int32_t size, const int32_t* fds) {
  auto ends = std::make_unique<Exchange>(rank, size, fds);
  std::lock_guard<std::mutex> lock(g_mu);
  g_exchanges[g_next_id] = std::move(ends);
  return g_next_id++;
}

void equarx_exchange_close(int64_t id) {
  std::unique_ptr<Exchange> ends;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_exchanges.find(id);
    if (it == g_exchanges.end()) return;
    ends = std::move(it->second);
    g_exchanges.erase(it);
  }
}

int64_t equarx_exchange_start(int64_t id, const uint8_t* data, int64_t n) {
  Exchange* ends = Find(id);
  return ends == nullptr ? -1 : ends->Start(data, static_cast<size_t>(n));
}

// 0, or the length of the reason written to `why` (at most why_size - 1 bytes).
int64_t equarx_exchange_finish(int64_t id, int64_t seq, uint8_t* out, int64_t n,
                               double timeout_s, char* why, int64_t why_size) {
  Exchange* ends = Find(id);
  std::string reason = ends == nullptr ? "no such exchange"
                                       : ends->Finish(seq, out, static_cast<size_t>(n), timeout_s);
  if (reason.empty()) return 0;
  const auto len = std::min<int64_t>(static_cast<int64_t>(reason.size()), why_size - 1);
  std::memcpy(why, reason.data(), static_cast<size_t>(len));
  why[len] = '\0';
  return len > 0 ? len : 1;
}

int64_t equarx_exchange_sent_bytes(int64_t id) {
  Exchange* ends = Find(id);
  return ends == nullptr ? 0 : ends->sent_bytes();
}

void equarx_exchange_record(int64_t id, int32_t on) {
  if (Exchange* ends = Find(id)) ends->Record(on != 0);
}

int64_t equarx_exchange_times(int64_t id, double* out, int64_t max) {
  Exchange* ends = Find(id);
  return ends == nullptr ? 0 : ends->CopyTimes(out, max);
}

}  // extern "C"
