// What dtactor reads from a Slurm job step's environment (app/slurm_env.hpp).
#include "app/slurm_env.hpp"

#include <gtest/gtest.h>

#include <map>

using namespace dtactor;

TEST(SlurmEnv, ExpandsHostLists) {
  std::string err;
  EXPECT_EQ(expand_slurm_hostlist("n[1-2]", err), (std::vector<std::string>{"n1", "n2"}));
  EXPECT_EQ(expand_slurm_hostlist("gpu[01-03,7],login", err), (std::vector<std::string>{"gpu01", "gpu02", "gpu03", "gpu7", "login"}));
  EXPECT_EQ(expand_slurm_hostlist("a,b[9-10]-ib", err), (std::vector<std::string>{"a", "b9-ib", "b10-ib"}));
  EXPECT_EQ(err, "");
  EXPECT_TRUE(expand_slurm_hostlist("n[1-", err).empty());
  EXPECT_NE(err, "");
  err.clear();
  EXPECT_TRUE(expand_slurm_hostlist("n[3-1]", err).empty());
  EXPECT_NE(err, "");
}

// Found by fuzz/slurm_hostlist: a bound of 20 digits made std::stol throw
// (the node process aborted), and ranges of 100,000 hosts each added up
// without limit.
TEST(SlurmEnv, RefusesHostListsItCannotExpand) {
  std::string err;
  EXPECT_TRUE(expand_slurm_hostlist("n[99600102260010226565]", err).empty());
  EXPECT_NE(err.find("malformed"), std::string::npos) << err;
  err.clear();
  EXPECT_TRUE(expand_slurm_hostlist("n[1-99999999999999999999]", err).empty());
  EXPECT_NE(err, "");
  err.clear();
  std::string many = "n[0-60000],m[0-60000]";
  EXPECT_TRUE(expand_slurm_hostlist(many, err).empty());
  EXPECT_NE(err.find("more than 100000 hosts"), std::string::npos) << err;
  err.clear();
  EXPECT_EQ(expand_slurm_hostlist("n[0-49999],m[0-49999]", err).size(), 100000u) << err;
}

TEST(SlurmEnv, ReadsTheAllocation) {
  std::map<std::string, std::string> env = {{"SLURM_JOB_ID", "4321"},         {"SLURM_STEP_ID", "0"},       {"SLURMD_NODENAME", "gpu02"},
                                            {"SLURM_JOB_NODELIST", "gpu[01-02]"}, {"SLURM_NODEID", "1"},       {"SLURM_JOB_NUM_NODES", "2"},
                                            {"SLURM_GPUS_ON_NODE", "4"},        {"SLURM_RESTART_COUNT", "2"}};
  auto get = [&](const char* k) -> const char* { return env.count(k) ? env[k].c_str() : nullptr; };
  EXPECT_TRUE(under_srun(get));
  std::string err;
  std::vector<std::string> asked;
  auto addr = [&](const std::string& n) {
    asked.push_back(n);
    return std::string("10.0.0.1");
  };
  auto l = slurm_launch_from(get, addr, err);
  ASSERT_TRUE(l) << err;
  EXPECT_EQ(l->node_name, "gpu02");
  EXPECT_EQ(l->node_index, 1);
  EXPECT_EQ(l->nnodes, 2);
  EXPECT_EQ(l->coordinator_host, "10.0.0.1");
  EXPECT_EQ(asked, (std::vector<std::string>{"gpu01"}));
  EXPECT_EQ(l->port, 20000 + 4321);
  EXPECT_EQ(l->gpus_on_node, 4);
  EXPECT_EQ(l->restart_count, 2);
  env["DTACTOR_COORDINATOR_PORT"] = "29400";
  EXPECT_EQ(slurm_launch_from(get, addr, err)->port, 29400);
  env["DTACTOR_COORDINATOR_PORT"] = "99999";
  EXPECT_FALSE(slurm_launch_from(get, addr, err));
  EXPECT_NE(err.find("DTACTOR_COORDINATOR_PORT"), std::string::npos);
  env.erase("DTACTOR_COORDINATOR_PORT");
  env.erase("SLURM_NODEID");  // the position in the list instead
  EXPECT_EQ(slurm_launch_from(get, addr, err)->node_index, 1);
  env["SLURMD_NODENAME"] = "other";
  EXPECT_FALSE(slurm_launch_from(get, addr, err));
  EXPECT_NE(err.find("not in SLURM_JOB_NODELIST"), std::string::npos) << err;
  env.erase("SLURM_STEP_ID");
  EXPECT_FALSE(under_srun(get)) << "a batch shell is not a job step";
}
