// A client of etcd's v3 API through its JSON gateway (etcd 3.4: POST /v3/kv/range, /v3/kv/put,
// /v3/kv/txn, /v3/kv/deleterange, /v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke),
// one HTTP/1.1 request per connection over a plain TCP socket with bounded timeouts. etcd
// holds the cluster's membership, slot map and leader lease; this is the only code that talks
// to it. Blocking: call it from the cluster's own threads, never from a shard's event loop.
#pragma once

#include <cstdint>
#include <functional>
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

  EtcdClient(EtcdEndpoint endpoint, int timeout_ms);

  // Errors are kClusterDown when etcd cannot be reached or answers with an HTTP error (the
  // message says which, with etcd's own text), kErr for a reply that does not parse.

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
  // Watches every key under `prefix` (POST /v3/watch, a stream): calls `on_event` each time
  // etcd sends something (the watch's creation, then every batch of changes) and returns when
  // the stream ends or breaks (kClusterDown), or once `keep_going` returns false (checked at
  // least every 200 ms; Ok). Blocking, for a thread of its own.
  Status Watch(std::string_view prefix, const std::function<bool()>& keep_going,
               const std::function<void()>& on_event);

  const EtcdEndpoint& endpoint() const { return endpoint_; }

 private:
  // POSTs `body` to `path`; the parsed JSON reply body.
  StatusOr<std::string> Post(std::string_view path, const std::string& body);

  EtcdEndpoint endpoint_;
  int timeout_ms_;
};

}  // namespace pion::cluster
