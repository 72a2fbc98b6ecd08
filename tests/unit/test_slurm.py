"""`launcher up --slurm`: the node list, this node and the spec's hosts from a Slurm environment
(the environment variables srun sets: a real input, given here as a plain mapping)."""

import pytest

from launcher.errors import UsageError
from launcher.slurm import expand_hostlist, from_slurm, spec_on_nodes, this_node
from launcher.topology import parse_gpu_spec
from tests.launching import child_env, run_launcher

ADDRESSES = {"node01": "10.0.0.1", "node02": "10.0.0.2", "node03": "10.0.0.3", "node07": "10.0.0.7", "gpu5": "10.0.1.5"}


@pytest.mark.parametrize(
    "text, nodes",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("n[001-002]x,m[1,3]", ["n001x", "n002x", "m1", "m3"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_hostlists_expand_as_slurm_does(text, nodes):
    assert expand_hostlist(text) == nodes


@pytest.mark.parametrize("text", ["node[01-03", "node[a-b]", "node[3-1]", "node]1[", ""])
def test_a_bad_hostlist_is_one_line(text):
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(text)


def test_this_node_is_slurmd_nodename_else_the_entry_at_slurm_nodeid():
    nodes = expand_hostlist("node[01-03]")
    assert this_node({"SLURMD_NODENAME": "node02", "SLURM_NODEID": "0"}, nodes) == "node02"
    assert this_node({"SLURM_NODEID": "2"}, nodes) == "node03"
    with pytest.raises(UsageError, match="srun"):
        this_node({}, nodes)
    with pytest.raises(UsageError, match="not in the job's nodes"):
        this_node({"SLURMD_NODENAME": "elsewhere"}, nodes)


def test_node_indices_and_ranges_become_groups_on_those_nodes():
    nodes = ["node01", "node02", "node03"]
    assert spec_on_nodes("0-7:target@0,0-3:drafter@1-2", nodes) == (
        "0-7:target@node01,0-3:drafter@node02,0-3:drafter@node03"
    )
    with pytest.raises(UsageError, match="node 3 of 3"):
        spec_on_nodes("0:target@0,0:drafter@3", nodes)
    with pytest.raises(UsageError, match="needs @NODE"):
        spec_on_nodes("0:target,0:drafter@1", nodes)


def test_a_slurm_environment_gives_the_spec_with_addresses_and_this_host():
    env = {
        "SLURM_JOB_NODELIST": "node[01-03,07],gpu5",
        "SLURMD_NODENAME": "node07",
        "SLURM_NODEID": "3",
        "SLURM_PROCID": "3",
    }
    gpus, host = from_slurm("0-7:target@0,0-3:drafter@3-4", env, resolve=ADDRESSES.__getitem__)
    assert gpus == "0-7:target@10.0.0.1,0-3:drafter@10.0.0.7,0-3:drafter@10.0.1.5" and host == "10.0.0.7"
    workers = parse_gpu_spec(gpus, local_host=host)
    assert [(w.name, w.host) for w in workers if w.role == "drafter"][::4] == [
        ("drafter-0", "10.0.0.7"),
        ("drafter-4", "10.0.1.5"),
    ]


def test_a_node_that_resolves_to_loopback_is_refused_across_nodes():
    env = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NODEID": "0"}
    resolve = {"node01": "127.0.1.1", "node02": "10.0.0.2"}.__getitem__
    with pytest.raises(UsageError, match="node01 resolves to 127.0.1.1"):
        from_slurm("0:target@0,0:drafter@1", env, resolve=resolve)


def test_without_slurm_it_says_to_use_srun():
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST is not set"):
        from_slurm("0:target@0,0:drafter@1", {})


@pytest.mark.processes
def test_launcher_up_slurm_says_what_is_missing_in_one_line():
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM")}
    out = run_launcher("up", "--slurm", "--device", "cpu", "--gpus", "0:target@0,0:drafter@1", env=env)
    assert out.returncode == 2 and "SLURM_JOB_NODELIST is not set" in out.stderr and "Traceback" not in out.stderr
    env.update(SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0")
    out = run_launcher(
        "up", "--slurm", "--host", "127.0.0.1", "--device", "cpu", "--gpus", "0:target@0,0:drafter@0", env=env
    )
    assert out.returncode == 2 and "--slurm sets --host" in out.stderr
    out = run_launcher("up", "--slurm", "--device", "cpu", "--gpus", "0:target@0,0:drafter@1", env=env)
    assert out.returncode == 2 and "node 1 of 1 (localhost)" in out.stderr
