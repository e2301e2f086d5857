// BandwidthMeter: the measured service rate of one transfer path (disk read, disk write, GPU
// upload, GPU download), as an exponentially weighted average of completed transfers, and the
// bytes queued on it — what admission estimates a promotion's finish time from (seed 004
// §0x08H: BW_effective is measured, not a datasheet number).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pion::residency {

class BandwidthMeter {
 public:
  explicit BandwidthMeter(double initial_bytes_per_s) : rate_(initial_bytes_per_s) {}

  // Bytes per second (any thread).
  double rate() const { return rate_.load(std::memory_order_relaxed); }
  // A transfer of `bytes` took `seconds` of service (any thread). Small transfers are dominated
  // by fixed costs and say little about the rate: they count in proportion to their size.
  void Record(uint64_t bytes, double seconds) {
    if (bytes == 0 || seconds <= 0) return;
    samples_.fetch_add(1, std::memory_order_relaxed);
    const double sample = static_cast<double>(bytes) / seconds;
    const double weight = std::min(0.5, static_cast<double>(bytes) / (64.0 * (1 << 20)) + 0.05);
    double cur = rate_.load(std::memory_order_relaxed);
    while (!rate_.compare_exchange_weak(cur, cur + weight * (sample - cur),
                                        std::memory_order_relaxed)) {
    }
  }
  // Seconds that `bytes` more would take behind what is queued.
  double Estimate(uint64_t bytes) const {
    return static_cast<double>(queued_.load(std::memory_order_relaxed) + bytes) / rate();
  }
  void Queue(uint64_t bytes) { queued_.fetch_add(bytes, std::memory_order_relaxed); }
  void Unqueue(uint64_t bytes) { queued_.fetch_sub(bytes, std::memory_order_relaxed); }
  uint64_t queued() const { return queued_.load(std::memory_order_relaxed); }
  // Transfers measured so far (0: rate() is still the initial guess).
  uint64_t samples() const { return samples_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> rate_;
  std::atomic<uint64_t> queued_{0};
  std::atomic<uint64_t> samples_{0};
};

}  // namespace pion::residency
