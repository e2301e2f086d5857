#include "families/shard_sum.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "server/server.h"

namespace pion::families {

void ReplySumOverShards(server::CommandContext& ctx, std::vector<SumField> fields,
                        std::function<std::vector<double>(server::Shard&)> per_shard) {
  ctx.server->FanOut(
      *ctx.shard, *ctx.conn,
      [per_shard = std::move(per_shard)](server::Shard& shard) {
        std::string out;
        char buf[32];
        for (double v : per_shard(shard)) {
          std::snprintf(buf, sizeof(buf), "%.17g ", v);
          out += buf;
        }
        return out;
      },
      [fields = std::move(fields)](std::vector<std::string>& parts, proto::ReplyBuilder& rb) {
        std::vector<double> sums(fields.size(), 0.0);
        for (const auto& p : parts) {
          const char* s = p.c_str();
          for (double& sum : sums) {
            char* end = nullptr;
            sum += std::strtod(s, &end);
            s = end;
          }
        }
        rb.Map(fields.size());
        for (size_t i = 0; i < fields.size(); ++i) {
          rb.Bulk(fields[i].name);
          if (fields[i].fractional) {
            rb.Double(sums[i], 3);  // sums of milliseconds
          } else {
            rb.Integer(static_cast<int64_t>(sums[i]));
          }
        }
      });
}

}  // namespace pion::families
