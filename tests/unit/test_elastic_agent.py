"""The pure parts of a drafter group across hosts: the ranks each host's agent gives its workers
(from the --gpus spec) and their check across hosts, and what the launcher starts on each host."""

import pytest

from launcher.supervisor import Supervisor
from launcher.topology import host_overrides, parse_gpu_spec
from launcher.units import UnitsError, render_units
from services.config import load_config
from services.drafter.agent import check_ranks, parse

SPEC = "0:target@10.0.0.1,0-1:drafter@10.0.0.10,0-1:drafter@10.0.0.2"


def supervisor(tmp_path, host: str, spec: str = SPEC) -> Supervisor:
    workers = parse_gpu_spec(spec, local_host=host)
    return Supervisor(
        tmp_path,
        load_config(None, [*host_overrides(workers), "transport.allow_plaintext=true"]),
        workers,
        "cpu",
        host=host,
    )


def test_ranks_that_add_up_pass_and_others_name_the_hosts():
    assert check_ranks({"10.0.0.10": [0, 1], "10.0.0.2": [2, 3]}, 4) == ""
    twice = check_ranks({"a": [0, 1], "b": [1, 2]}, 3)
    assert "drafter rank 1 is claimed by a and b" in twice and "--gpus" in twice
    assert "no host runs drafter rank(s) [3]" in check_ranks({"a": [0, 1], "b": [2]}, 4)
    assert "past 2" in check_ranks({"a": [0, 1], "b": [2]}, 2)


def test_each_drafter_host_starts_one_agent_with_the_spec_ranks_in_spec_order(tmp_path):
    # 10.0.0.10 sorts before 10.0.0.2 as text (torch's rendezvous order): the ranks come from the spec
    first, second = supervisor(tmp_path, "10.0.0.10"), supervisor(tmp_path, "10.0.0.2")
    assert first.elastic and second.elastic
    a = parse(first.agent_argv([w for w in first.local if w.role == "drafter"])[3:])
    b = parse(second.agent_argv([w for w in second.local if w.role == "drafter"])[3:])
    assert (a.ranks, b.ranks) == ([0, 1], [2, 3]) and a.world_size == b.world_size == 4
    assert a.hosts == b.hosts == ["10.0.0.10", "10.0.0.2"]  # the first is rank 0's: the rendezvous store
    assert a.run_id == b.run_id and a.port == b.port == first.cfg.transport.dist_port
    assert "--rank" not in a.worker and "--world-size" not in a.worker  # RANK, WORLD_SIZE from the agent
    assert a.worker[1:3] == ["-m", "services.drafter"]
    assert "MASTER_ADDR" not in first.env(first.local[0])  # the agent sets it: rank 0's address, dist_port + 1


def test_a_target_host_and_a_one_host_drafter_group_start_no_agent(tmp_path):
    assert not supervisor(tmp_path, "10.0.0.1").local_group
    one = supervisor(tmp_path, "10.0.0.1", "0:target@10.0.0.1,0-1:drafter@10.0.0.2")
    assert not one.elastic


def test_units_refuse_a_drafter_group_across_hosts_and_say_what_to_run(tmp_path):
    with pytest.raises(UnitsError, match="launcher up --gpus SPEC --host HOST"):
        render_units(SPEC, None, str(tmp_path / "out"), str(tmp_path / "run"), device="cpu")
