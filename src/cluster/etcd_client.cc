#include "cluster/etcd_client.h"

#include <curl/curl.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <mutex>
#include <system_error>

#include "cluster/etcd_json.h"

namespace pion::cluster {
namespace {

using etcd_json::Json;
using Clock = std::chrono::steady_clock;

Status Down(const EtcdEndpoint& ep, const std::string& what) {
  return Status(ErrorKind::kClusterDown,
                "etcd at " + ep.host + ":" + std::to_string(ep.port) + " " + what);
}

// libcurl's own words for a failed transfer.
std::string Detail(CURLcode rc, const char* errbuf) {
  return errbuf[0] != '\0' ? errbuf : curl_easy_strerror(rc);
}

// What went wrong with a transfer, in the words the rest of the cluster code (and CLUSTER INFO's
// cluster_etcd_last_error) uses: "is unreachable: Connection refused", "did not answer ...".
std::string Describe(CURL* h, CURLcode rc, const char* errbuf, std::string_view path,
                     int timeout_ms) {
  const std::string detail = Detail(rc, errbuf);
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
      return "cannot be resolved: " + detail;
    case CURLE_COULDNT_CONNECT: {
      long os_errno = 0;
      curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os_errno);
      return "is unreachable: " +
             (os_errno != 0 ? std::generic_category().message(static_cast<int>(os_errno)) : detail);
    }
    case CURLE_OPERATION_TIMEDOUT: {
      curl_off_t connected_us = 0;
      curl_easy_getinfo(h, CURLINFO_CONNECT_TIME_T, &connected_us);
      if (connected_us == 0) return "is unreachable: connect timed out";
      return "did not answer " + std::string(path) + " within " + std::to_string(timeout_ms) +
             " ms";
    }
    case CURLE_GOT_NOTHING:
      return "closed the connection before answering " + std::string(path);
    case CURLE_SEND_ERROR:
      return "did not take the request " + std::string(path) + ": " + detail;
    default:
      return "broke off answering " + std::string(path) + ": " + detail;
  }
}

// etcd's text in an HTTP error reply ({"error": ..., "message": ..., "code": ...}).
std::string RefusalText(std::string_view body) {
  auto j = etcd_json::Parse(body);
  if (j.ok()) {
    if (std::string m = etcd_json::Text(j.value(), "message"); !m.empty()) return m;
    if (std::string e = etcd_json::Text(j.value(), "error"); !e.empty()) return e;
  }
  return std::string(body.substr(0, 300));
}

size_t AppendTo(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

// Options every request and the watch share.
void SetCommon(CURL* h, const std::string& url, int timeout_ms, curl_slist* headers,
               const std::string& body, char* errbuf) {
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for name-lookup timeouts
  curl_easy_setopt(h, CURLOPT_PROXY, "");     // never through an http_proxy of the environment
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(timeout_ms));
  curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
  errbuf[0] = '\0';
}

std::string B64(std::string_view bytes) { return etcd_json::Base64Encode(bytes); }

StatusOr<EtcdClient::Kv> KvOf(const Json& j) {
  EtcdClient::Kv kv;
  auto key = etcd_json::Base64Decode(etcd_json::Text(j, "key"));
  if (!key.ok()) return key.status();
  auto value = etcd_json::Base64Decode(etcd_json::Text(j, "value"));
  if (!value.ok()) return value.status();
  kv.key = std::move(key).value();
  kv.value = std::move(value).value();
  kv.create_revision = etcd_json::Int(j, "create_revision");
  kv.mod_revision = etcd_json::Int(j, "mod_revision");
  kv.lease = etcd_json::Int(j, "lease");
  return kv;
}

// The key just past every key with this prefix (etcd's range_end for a prefix).
std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char c = static_cast<unsigned char>(end.back());
    if (c < 0xff) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

struct EasyDeleter {
  void operator()(CURL* h) const { curl_easy_cleanup(h); }
};
struct MultiDeleter {
  void operator()(CURLM* m) const { curl_multi_cleanup(m); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;
using Multi = std::unique_ptr<CURLM, MultiDeleter>;

// One watch stream's state, fed by libcurl's write callback on the watching thread.
struct WatchStream {
  const EtcdEndpoint* endpoint;
  std::string_view prefix;
  const std::function<void()>* on_event;
  CURL* handle;
  long http_code = 0;
  std::string refusal;  // the body of a non-200 answer
  etcd_json::MessageStream messages;
  bool open = false;  // etcd confirmed the watch's creation
  Status error;       // why the stream was given up, when a message said so

  bool OnMessage(std::string_view text) {
    auto j = etcd_json::Parse(text);
    if (!j.ok()) {
      error = Down(*endpoint, "sent a watch message that is not JSON: " + j.status().message());
      return false;
    }
    if (const Json& e = etcd_json::Member(j.value(), "error"); !e.is_null()) {
      error = Down(*endpoint, "ended the watch stream: " + etcd_json::Text(e, "message"));
      return false;
    }
    const Json& r = etcd_json::Member(j.value(), "result");
    if (etcd_json::Bool(r, "canceled")) {
      error = Down(*endpoint, "canceled the watch: " + etcd_json::Text(r, "cancel_reason"));
      return false;
    }
    const int64_t revision = etcd_json::Int(etcd_json::Member(r, "header"), "revision");
    if (etcd_json::Bool(r, "created")) {
      open = true;
      spdlog::info("cluster: watch on {} open at etcd {}:{} (revision {})", prefix, endpoint->host,
                   endpoint->port, revision);
    }
    if (spdlog::should_log(spdlog::level::debug)) {
      for (const Json& ev : etcd_json::Member(r, "events")) {
        const std::string type = etcd_json::Text(ev, "type");  // PUT (0) is omitted
        auto key = etcd_json::Base64Decode(etcd_json::Text(etcd_json::Member(ev, "kv"), "key"));
        spdlog::debug("cluster: watch on {}: {} {} (revision {})", prefix,
                      type.empty() ? "PUT" : type, key.ok() ? key.value() : "?", revision);
      }
    }
    (*on_event)();
    return true;
  }

  static size_t Write(char* data, size_t size, size_t n, void* self_ptr) {
    auto* self = static_cast<WatchStream*>(self_ptr);
    const size_t len = size * n;
    if (self->http_code == 0)
      curl_easy_getinfo(self->handle, CURLINFO_RESPONSE_CODE, &self->http_code);
    if (self->http_code != 200) {
      if (self->refusal.size() < 4096) self->refusal.append(data, len);
      return len;
    }
    const bool go_on = self->messages.Feed(
        std::string_view(data, len), [self](std::string_view m) { return self->OnMessage(m); });
    return go_on ? len : 0;  // 0: libcurl ends the transfer
  }
};

}  // namespace

struct EtcdClient::Handles {
  std::mutex mu;
  std::vector<CURL*> idle;  // each keeps its connection to etcd open
  curl_slist* headers = nullptr;

  ~Handles() {
    for (CURL* h : idle) curl_easy_cleanup(h);
    curl_slist_free_all(headers);
  }
  CURL* Take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        CURL* h = idle.back();
        idle.pop_back();
        return h;
      }
    }
    return curl_easy_init();
  }
  void Give(CURL* h) {
    std::lock_guard<std::mutex> lock(mu);
    idle.push_back(h);
  }
};

StatusOr<EtcdEndpoint> ParseEtcdUrl(std::string_view url) {
  std::string_view rest = url;
  for (std::string_view scheme : {"etcd://", "http://"}) {
    if (rest.substr(0, scheme.size()) == scheme) {
      rest.remove_prefix(scheme.size());
      break;
    }
  }
  if (rest.size() == url.size()) {
    return Error("--cluster must be etcd://host:port (e.g. etcd://127.0.0.1:2379), got '" +
                 std::string(url) + "'");
  }
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  EtcdEndpoint ep;
  const size_t colon = rest.rfind(':');
  ep.host = std::string(rest.substr(0, colon));
  if (colon != std::string_view::npos) {
    const std::string port(rest.substr(colon + 1));
    char* end = nullptr;
    const long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || p < 1 || p > 65535) {
      return Error("--cluster port must be in [1, 65535], got '" + port + "'");
    }
    ep.port = static_cast<int>(p);
  }
  if (ep.host.empty())
    return Error("--cluster needs a host: etcd://host:port, got '" + std::string(url) + "'");
  return ep;
}

EtcdClient::EtcdClient(EtcdEndpoint endpoint, int timeout_ms)
    : endpoint_(std::move(endpoint)),
      timeout_ms_(timeout_ms),
      base_url_("http://" + endpoint_.host + ":" + std::to_string(endpoint_.port)),
      handles_(std::make_unique<Handles>()) {
  static std::once_flag curl_ready;
  std::call_once(curl_ready, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  handles_->headers = curl_slist_append(nullptr, "Content-Type: application/json");
  // No "Expect: 100-continue" round trip before a large body (the slot map).
  handles_->headers = curl_slist_append(handles_->headers, "Expect:");
}

EtcdClient::~EtcdClient() = default;

StatusOr<Json> EtcdClient::Post(std::string_view path, const Json& body, bool stream) {
  const std::string url = base_url_ + std::string(path);
  const std::string text = etcd_json::Dump(body);
  CURL* h = handles_->Take();
  if (h == nullptr) return Down(endpoint_, "cannot be asked: libcurl could not start a request");
  std::string reply;
  char errbuf[CURL_ERROR_SIZE];
  curl_easy_reset(h);  // options only: the connection and the resolved address stay
  SetCommon(h, url, timeout_ms_, handles_->headers, text, errbuf);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_ms_));
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, AppendTo);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &reply);
  const CURLcode rc = curl_easy_perform(h);
  long code = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
  const std::string failure = rc == CURLE_OK ? "" : Describe(h, rc, errbuf, path, timeout_ms_);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);  // errbuf is about to go
  handles_->Give(h);
  if (rc != CURLE_OK) return Down(endpoint_, failure);
  if (code != 200) {
    return Down(endpoint_, "refused " + std::string(path) + " (HTTP " + std::to_string(code) +
                               "): " + RefusalText(reply));
  }
  std::string_view doc = reply;
  if (stream) doc = doc.substr(0, doc.find('\n'));  // a stream of one message: the first
  return etcd_json::Parse(doc);
}

StatusOr<int64_t> EtcdClient::Grant(int ttl_s) {
  auto r = Post("/v3/lease/grant", {{"TTL", std::to_string(ttl_s)}});
  if (!r.ok()) return r.status();
  const int64_t id = etcd_json::Int(r.value(), "ID");
  if (id == 0) return Error("etcd granted no lease: " + etcd_json::Dump(r.value()).substr(0, 200));
  return id;
}

Status EtcdClient::KeepAlive(int64_t lease) {
  // A stream of one message: {"result":{"ID":..,"TTL":..}}; TTL absent (0) = expired.
  auto r = Post("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, /*stream=*/true);
  if (!r.ok()) return r.status();
  if (etcd_json::Int(etcd_json::Member(r.value(), "result"), "TTL") <= 0) {
    return Status(ErrorKind::kMiss, "lease " + std::to_string(lease) + " expired");
  }
  return Status::Ok();
}

Status EtcdClient::Revoke(int64_t lease) {
  auto r = Post("/v3/lease/revoke", {{"ID", std::to_string(lease)}});
  return r.ok() ? Status::Ok() : r.status();
}

StatusOr<EtcdClient::Kv> EtcdClient::Get(std::string_view key) {
  auto r = Post("/v3/kv/range", {{"key", B64(key)}});
  if (!r.ok()) return r.status();
  const Json& kvs = etcd_json::Member(r.value(), "kvs");
  if (!kvs.is_array() || kvs.empty()) return Status(ErrorKind::kMiss, "no key " + std::string(key));
  return KvOf(kvs[0]);
}

StatusOr<std::vector<EtcdClient::Kv>> EtcdClient::List(std::string_view prefix) {
  auto r = Post("/v3/kv/range", {{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}});
  if (!r.ok()) return r.status();
  std::vector<Kv> out;
  for (const Json& item : etcd_json::Member(r.value(), "kvs")) {
    auto kv = KvOf(item);
    if (!kv.ok()) return kv.status();
    out.push_back(std::move(kv).value());
  }
  return out;
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) {
  Json body = {{"key", B64(key)}, {"value", B64(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  auto r = Post("/v3/kv/put", body);
  return r.ok() ? Status::Ok() : r.status();
}

StatusOr<bool> EtcdClient::PutIf(std::string_view key, std::string_view value,
                                 int64_t expect_mod_revision, int64_t lease) {
  const std::string k = B64(key);
  const Json compare =
      expect_mod_revision == 0
          ? Json{{"target", "CREATE"}, {"result", "EQUAL"}, {"key", k}, {"create_revision", "0"}}
          : Json{{"target", "MOD"},
                 {"result", "EQUAL"},
                 {"key", k},
                 {"mod_revision", std::to_string(expect_mod_revision)}};
  Json put = {{"key", k}, {"value", B64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  const Json body = {{"compare", Json::array({compare})},
                     {"success", Json::array({{{"request_put", put}}})}};
  auto r = Post("/v3/kv/txn", body);
  if (!r.ok()) return r.status();
  return etcd_json::Bool(r.value(), "succeeded");
}

Status EtcdClient::Delete(std::string_view key) {
  auto r = Post("/v3/kv/deleterange", {{"key", B64(key)}});
  return r.ok() ? Status::Ok() : r.status();
}

Status EtcdClient::Watch(std::string_view prefix, const std::function<bool()>& keep_going,
                         const std::function<void()>& on_event) {
  const std::string body = etcd_json::Dump(
      {{"create_request", {{"key", B64(prefix)}, {"range_end", B64(PrefixEnd(prefix))}}}});
  const std::string url = base_url_ + "/v3/watch";
  Easy h(curl_easy_init());
  Multi m(curl_multi_init());
  if (!h || !m) return Down(endpoint_, "cannot be watched: libcurl could not start a request");
  char errbuf[CURL_ERROR_SIZE];
  WatchStream ws{&endpoint_, prefix, &on_event, h.get()};
  SetCommon(h.get(), url, timeout_ms_, handles_->headers, body, errbuf);
  curl_easy_setopt(h.get(), CURLOPT_WRITEFUNCTION, WatchStream::Write);
  curl_easy_setopt(h.get(), CURLOPT_WRITEDATA, &ws);
  // A quiet stream is normal; a peer that vanished without closing is found by TCP keepalives.
  curl_easy_setopt(h.get(), CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(h.get(), CURLOPT_TCP_KEEPIDLE, 5L);
  curl_easy_setopt(h.get(), CURLOPT_TCP_KEEPINTVL, 5L);
  curl_multi_add_handle(m.get(), h.get());

  const Clock::time_point open_by = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  Status result = Status::Ok();
  while (keep_going()) {
    int running = 0;
    const CURLMcode mc = curl_multi_perform(m.get(), &running);
    if (!ws.error.ok()) {
      result = ws.error;
      break;
    }
    if (mc != CURLM_OK) {
      result = Down(endpoint_, std::string("broke off the watch: ") + curl_multi_strerror(mc));
      break;
    }
    if (running == 0) {
      CURLcode rc = CURLE_OK;
      int left = 0;
      while (CURLMsg* msg = curl_multi_info_read(m.get(), &left)) {
        if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
      }
      long code = 0;
      curl_easy_getinfo(h.get(), CURLINFO_RESPONSE_CODE, &code);
      if (code != 0 && code != 200) {
        result = Down(endpoint_, "refused the watch (HTTP " + std::to_string(code) +
                                     "): " + RefusalText(ws.refusal));
      } else if (rc == CURLE_OK) {
        result = Down(endpoint_, "ended the watch stream");
      } else if (ws.open) {
        result = Down(endpoint_, "ended the watch stream: " + Detail(rc, errbuf));
      } else {
        result = Down(endpoint_, Describe(h.get(), rc, errbuf, "/v3/watch", timeout_ms_));
      }
      break;
    }
    if (!ws.open && Clock::now() > open_by) {
      result =
          Down(endpoint_, "did not open the watch within " + std::to_string(timeout_ms_) + " ms");
      break;
    }
    curl_multi_poll(m.get(), nullptr, 0, 200, nullptr);
  }
  curl_multi_remove_handle(m.get(), h.get());
  if (ws.open && !result.ok())
    spdlog::info("cluster: watch on {} ended: {}", prefix, result.message());
  return result;
}

}  // namespace pion::cluster
