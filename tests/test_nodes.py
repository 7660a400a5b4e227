"""Which node each rank is on, under the environments real launchers leave behind (hybrid.core.nodes).

Each case writes down, per rank, the variables that launcher sets (names and meanings from its own
documentation), builds every rank's report from them as hybrid.attach does, and checks the nodes found.
"""

import logging

import pytest

from hybrid.core.nodes import HOSTNAME, local_report, topology_from_reports

pytestmark = pytest.mark.unit


def nodes(environments, hosts=None, node_ranks=None):
    """(nodes, source) that rank 0 finds, from each rank's environment (and host name)."""
    hosts = hosts or ["box"] * len(environments)
    node_ranks = node_ranks or [None] * len(environments)
    reports = [local_report(rank, env, host, node_rank)
               for rank, (env, host, node_rank) in enumerate(zip(environments, hosts, node_ranks))]
    topology, source = topology_from_reports(0, reports)
    return topology.nodes, source


def test_torchrun_group_rank():
    envs = [{"RANK": str(r), "GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
            for r in range(4)]
    assert nodes(envs) == (((0, 1), (2, 3)), "GROUP_RANK")


def test_slurm_one_task_per_gpu_cyclic_placement():
    """srun --distribution=cyclic: ranks alternate between nodes; SLURM_LOCALID orders them inside one."""
    envs = [{"SLURM_PROCID": str(r), "SLURM_NODEID": str(r % 2), "SLURM_LOCALID": str(r // 2)} for r in range(4)]
    assert nodes(envs, hosts=["gpu-a", "gpu-b"] * 2) == (((0, 2), (1, 3)), "SLURM_NODEID")


def test_ray_train_sets_node_rank_only():
    envs = [{"RANK": str(r), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(r // 2)}
            for r in range(4)]
    assert nodes(envs, hosts=["ray-0", "ray-0", "ray-1", "ray-1"]) == (((0, 1), (2, 3)), "NODE_RANK")


def test_kubernetes_indexed_job_node_rank_and_uneven_nodes():
    """An Indexed Job's pod index exported as NODE_RANK; pod 1 runs its ranks in another order, 3 + 1 workers."""
    envs = [{"NODE_RANK": "0", "LOCAL_RANK": "0"}, {"NODE_RANK": "1", "LOCAL_RANK": "0"},
            {"NODE_RANK": "0", "LOCAL_RANK": "2"}, {"NODE_RANK": "0", "LOCAL_RANK": "1"}]
    found, source = nodes(envs, hosts=["pod-0", "pod-1", "pod-0", "pod-0"])
    assert (found, source) == (((0, 3, 2), (1,)), "NODE_RANK")


def test_no_node_variable_groups_ranks_by_host_name_in_order_of_their_lowest_rank():
    """submitit with a task per GPU, mpirun, a hand-rolled launcher: nothing names the node."""
    envs = [{"LOCAL_RANK": str(r % 2)} for r in range(4)]
    assert nodes(envs, hosts=["zeta", "zeta", "alpha", "alpha"]) == (((0, 1), (2, 3)), HOSTNAME)
    assert nodes([{}] * 3, hosts=["b", "a", "b"]) == (((0, 2), (1,)), HOSTNAME)


def test_one_machine_is_one_node_by_host_name_even_with_two_launchers_on_it():
    envs = [{"LOCAL_RANK": str(r % 2)} for r in range(4)]  # two agents' local ranks repeat
    assert nodes(envs) == (((0, 1, 2, 3),), HOSTNAME)


def test_a_program_that_knows_its_node_wins_over_the_environment():
    envs = [{"NODE_RANK": "0", "LOCAL_RANK": str(r % 2)} for r in range(4)]  # a stale NODE_RANK=0 everywhere
    assert nodes(envs, node_ranks=[0, 0, 1, 1]) == (((0, 1), (2, 3)), "node_rank")


def test_a_variable_that_only_some_ranks_have_is_passed_over():
    envs = [{"GROUP_RANK": "0", "SLURM_NODEID": "0"}, {"GROUP_RANK": "0", "SLURM_NODEID": "0"},
            {"SLURM_NODEID": "1"}, {"SLURM_NODEID": "1"}]
    assert nodes(envs) == (((0, 1), (2, 3)), "SLURM_NODEID")


def test_a_node_variable_that_repeats_local_ranks_is_refused_with_the_numbers():
    envs = [{"NODE_RANK": "0", "LOCAL_RANK": str(r % 2)} for r in range(4)]
    with pytest.raises(ValueError) as err:
        nodes(envs, hosts=["a", "a", "b", "b"])
    message = str(err.value)
    assert "NODE_RANK=0" in message and "[0, 1, 2, 3]" in message and "[0, 1, 0, 1]" in message
    assert "\n" not in message


def test_a_node_over_several_host_names_is_warned_about(caplog):
    envs = [{"GROUP_RANK": "0", "LOCAL_RANK": "0"}, {"GROUP_RANK": "0", "LOCAL_RANK": "1"}]
    with caplog.at_level(logging.WARNING, logger="hybrid.core.nodes"):
        assert nodes(envs, hosts=["a", "b"]) == (((0, 1),), "GROUP_RANK")
    assert "['a', 'b']" in caplog.text


def test_a_node_variable_that_is_not_a_number_names_itself():
    with pytest.raises(ValueError, match=r"SLURM_NODEID='n1' is not an integer"):
        local_report(0, {"SLURM_NODEID": "n1"}, "box")
