#include "actors/rank_actor.hpp"

#include "caf/send.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

using rank_self = rank_actor_handle::stateful_pointer<rank_actor_state>;

namespace {

// The callbacks the training thread reports through: each puts its
// message into the matching body of an envelope and sends it to this actor
// (report_atom), which stamps and forwards it.
rank_work_callbacks report_callbacks(rank_self self) {
  auto relay = [self](uint64_t gen, pb::envelope env) {
    caf::anon_send(caf::actor_cast<rank_actor_handle>(self), report_atom::value, gen, inbound{"node", "", std::move(env)});
  };
  auto into = [relay](auto mutable_body) {
    return [relay, mutable_body](uint64_t gen, auto msg) {
      pb::envelope e;
      *(e.*mutable_body)() = std::move(msg);
      relay(gen, std::move(e));
    };
  };
  rank_work_callbacks cb;
  cb.on_step = into(&pb::envelope::mutable_step_report);
  cb.on_eval = into(&pb::envelope::mutable_eval_report);
  cb.on_checkpoint = into(&pb::envelope::mutable_checkpoint_written);
  cb.on_status = into(&pb::envelope::mutable_rank_status);
  return cb;
}

// The node agent's message: a plan goes to the work (the newest it took is
// what heartbeats carry); a checkpointed shutdown asks the work to stop at
// an agreed step, any other ends the work and this actor.
void on_node_message(rank_self self, const inbound& in) {
  auto& st = self->state;
  if (in.env.has_generation_plan()) {
    if (!in.env.job_id().empty()) st.opts.header.job_id = in.env.job_id();
    if (st.work && st.work->offer(in.env.generation_plan())) st.newest_plan = std::max(st.newest_plan, in.env.generation_plan().generation());
  } else if (in.env.has_spare_slot()) {
    // Once, and only while a spare: its reports speak for that rank now.
    const int32_t l = in.env.spare_slot().local_rank();
    if (st.opts.local_rank >= 0 || l < 0) return;
    st.opts.local_rank = l;
    st.opts.header.sender = sender_id::of_rank(st.opts.node_id, l).to_string();
    if (st.work) st.work->take_slot(l);
  } else if (in.env.has_shutdown()) {
    if (in.env.shutdown().checkpoint()) {
      if (st.work) st.work->request_stop(true);
      return;
    }
    if (st.work) st.work->quit();
    self->quit();
  }
}

}  // namespace

rank_actor_handle::behavior_type rank_actor(rank_self self, rank_actor_options opts) {
  auto& st = self->state;
  st.opts = std::move(opts);
  if (st.opts.make_work) st.work = st.opts.make_work(report_callbacks(self));
  return {
      [=](start_atom) {
        auto& st = self->state;
        pb::envelope hello = make_envelope(st.opts.header, 0);
        hello.mutable_rank_hello()->set_local_rank(st.opts.local_rank);
        hello.mutable_rank_hello()->set_pid(st.opts.pid);
        st.opts.send(std::move(hello));
        self->send(self, tick_atom::value);
      },
      [=](tick_atom) {
        auto& st = self->state;
        pb::envelope hb = make_envelope(st.opts.header, st.newest_plan);
        hb.mutable_heartbeat()->set_seq(++st.heartbeat_seq);
        st.opts.send(std::move(hb));
        self->delayed_send(self, st.opts.heartbeat_interval, tick_atom::value);
      },
      [=](report_atom, uint64_t gen, inbound& in) {
        auto& st = self->state;
        pb::envelope env = make_envelope(st.opts.header, gen);
        env.MergeFrom(in.env);
        env.set_generation(gen);
        ++st.reports;
        st.opts.send(std::move(env));
      },
      [=](inbound& in) { on_node_message(self, in); },
  };
}

}  // namespace dtactor
