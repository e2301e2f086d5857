// A client of etcd's v3 API through its JSON gateway (etcd 3.4: POST /v3/kv/range, /v3/kv/put,
// /v3/kv/txn, /v3/kv/deleterange, /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke and
// the /v3/watch stream), over libcurl (Debian's libcurl4-openssl-dev) with bounded timeouts;
// the JSON through etcd_json (nlohmann-json). etcd holds the cluster's membership, slot map and
// leader lease; this is the only code that talks to it. Blocking: call it from the cluster's own
// threads, never from a shard's event loop. Safe to call from several threads at once: each
// request takes a curl handle of its own from a pool, whose connections stay open between
// requests (HTTP keep-alive).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pion::cluster {

struct EtcdEndpoint {
  std::string host;
  int port = 2379;
};

// "etcd://host:port" (or "http://host:port"; the port defaults to 2379). kError names what
// is wrong with the text.
StatusOr<EtcdEndpoint> ParseEtcdUrl(std::string_view url);

class EtcdClient {
 public:
  struct Kv {
    std::string key;
    std::string value;
    int64_t create_revision = 0;
    int64_t mod_revision = 0;
    int64_t lease = 0;
  };

  // `timeout_ms` bounds each request (connecting and answering) and the opening of a watch.
  EtcdClient(EtcdEndpoint endpoint, int timeout_ms);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // Errors are kClusterDown when etcd cannot be reached or answers with an HTTP error (the
  // message, "etcd at host:port ...", says which, with etcd's own text), kErr for a reply that
  // does not parse.

  // A lease of `ttl_s` seconds; returns its id.
  StatusOr<int64_t> Grant(int ttl_s);
  // Renews `lease`. kMiss when etcd no longer knows it (it expired).
  Status KeepAlive(int64_t lease);
  Status Revoke(int64_t lease);
  // The value of `key` (kMiss when absent).
  StatusOr<Kv> Get(std::string_view key);
  // Every key starting with `prefix`, in key order.
  StatusOr<std::vector<Kv>> List(std::string_view prefix);
  // Puts `key` = `value` (attached to `lease` when non-zero).
  Status Put(std::string_view key, std::string_view value, int64_t lease);
  // Puts only when the key's mod revision is `expect_mod_revision` (0: only when the key does
  // not exist). False when the comparison failed (someone else changed it first).
  StatusOr<bool> PutIf(std::string_view key, std::string_view value, int64_t expect_mod_revision,
                       int64_t lease);
  Status Delete(std::string_view key);
  // Watches every key under `prefix` (POST /v3/watch, a stream of newline-delimited messages):
  // calls `on_event` for each message etcd sends (the watch's creation, then every batch of
  // changes) and returns when the stream ends, breaks, or etcd cancels the watch (kClusterDown),
  // or once `keep_going` returns false (checked at least every 200 ms; Ok). The caller reopens
  // it; a new watch starts at etcd's current revision, so re-read what it watches on its
  // creation. Logs the opening (info) and each change (debug). Blocking, for a thread of its own.
  Status Watch(std::string_view prefix, const std::function<bool()>& keep_going,
               const std::function<void()>& on_event);

  const EtcdEndpoint& endpoint() const { return endpoint_; }

 private:
  struct Handles;  // idle curl handles, the request headers

  // POSTs `body` to `path`; the reply parsed (its first message when `stream`).
  StatusOr<nlohmann::json> Post(std::string_view path, const nlohmann::json& body,
                                bool stream = false);

  EtcdEndpoint endpoint_;
  int timeout_ms_;
  std::string base_url_;  // http://host:port
  std::unique_ptr<Handles> handles_;
};

}  // namespace pion::cluster
