#include "rank/zero_sync.hpp"

#include "comm/exchange.hpp"
#include "comm/grad_sync.hpp"
#include "comm/shm_group.hpp"
#include "model/flat_adamw.hpp"
#include "model/shard_plan.hpp"
#include "rank/zero.hpp"

namespace dtactor {

namespace {

// What every path holds: the optimizer, the plan, the group and the waits.
class zero_sync_base : public param_sync {
 public:
  zero_sync_base(flat_adamw& opt, const shard_plan& shards, zero_sync_settings s) : opt_(opt), shards_(shards), s_(std::move(s)) {}
  bool sharded_norm() const override { return s_.sharded_norm; }
  result<double> global_norm() override { return global_grad_norm(*s_.pg, opt_, shards_, s_.timeout, s_.abandon); }

 protected:
  flat_adamw& opt_;
  const shard_plan& shards_;  // the generation's (the rank worker's, alive as long as the reducer)
  zero_sync_settings s_;
};

class over_group final : public zero_sync_base {
 public:
  using zero_sync_base::zero_sync_base;
  status gather() override { return gather_params(*s_.pg, opt_, shards_, s_.timeout, s_.abandon); }
  std::string describe() const override { return "over " + s_.backend; }
};

class over_segment final : public zero_sync_base {
 public:
  over_segment(std::shared_ptr<shm_group> shm, flat_adamw& opt, const shard_plan& shards, zero_sync_settings s)
      : zero_sync_base(opt, shards, std::move(s)), shm_(std::move(shm)) {}
  result<double> global_norm() override { return global_grad_norm_shm(*shm_, opt_, shards_, s_.timeout, s_.abandon, s_.spin); }
  status gather() override { return gather_params_shm(*shm_, opt_, shards_, s_.timeout, s_.abandon, s_.spin); }
  std::string describe() const override { return "through shared memory"; }

 private:
  std::shared_ptr<shm_group> shm_;
};

class within_hosts final : public zero_sync_base {
 public:
  within_hosts(std::shared_ptr<shm_group> shm, std::vector<int> members, flat_adamw& opt, const shard_plan& shards, zero_sync_settings s)
      : zero_sync_base(opt, shards, std::move(s)), shm_(std::move(shm)), members_(std::move(members)) {}
  status gather() override {
    if (!shm_) return {};  // alone on this host: it holds every shard
    return gather_params_host(*shm_, members_, opt_, shards_, s_.timeout, s_.abandon, s_.spin);
  }
  std::string describe() const override { return "within each host through shared memory (every host holds every shard)"; }

 private:
  std::shared_ptr<shm_group> shm_;
  std::vector<int> members_;
};

}  // namespace

std::unique_ptr<param_sync> zero_sync_over_group(flat_adamw& opt, const shard_plan& shards, zero_sync_settings s) {
  return std::make_unique<over_group>(opt, shards, std::move(s));
}

std::unique_ptr<param_sync> zero_sync_over_segment(std::shared_ptr<shm_group> shm, flat_adamw& opt, const shard_plan& shards,
                                                   zero_sync_settings s) {
  return std::make_unique<over_segment>(std::move(shm), opt, shards, std::move(s));
}

std::unique_ptr<param_sync> zero_sync_within_hosts(std::shared_ptr<shm_group> shm, std::vector<int> members, flat_adamw& opt,
                                                   const shard_plan& shards, zero_sync_settings s) {
  return std::make_unique<within_hosts>(std::move(shm), std::move(members), opt, shards, std::move(s));
}

std::unique_ptr<param_sync> zero_sync_for(const grad_sync& sync, const exchange_plan& plan, flat_adamw& opt, const shard_plan* shards,
                                          zero_sync_settings s) {
  if (!shards || !s.pg || s.pg->getSize() <= 1) return nullptr;
  // Every rank on this host with the gradients through its segment.
  if (sync.uses_shm() && !sync.hierarchical() && plan.shm && shm_fits(*plan.shm, opt, *shards))
    return zero_sync_over_segment(plan.shm, opt, *shards, std::move(s));
  // Decided from the plan and the hosts, alike on every rank.
  if (plan.hierarchical && hosts_cover_every_shard(*shards, plan.host_groups) && params_float32(opt, *shards))
    return zero_sync_within_hosts(plan.shm, plan.host_members, opt, *shards, std::move(s));
  return zero_sync_over_group(opt, *shards, std::move(s));
}

}  // namespace dtactor
