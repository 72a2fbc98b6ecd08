"""The launcher as a user runs it: a real console script in a real subprocess."""

import subprocess
import sys
import time

import pytest

from launcher.topology import GpuSpecError, parse_gpu_spec
from tests.launching import run_launcher


def test_spec_ranges_lists_and_ranks():
    workers = parse_gpu_spec("0-4:target,5-7:drafter", available=8)
    assert [(w.role, w.rank, w.gpu) for w in workers][:2] == [("target", 0, 0), ("target", 1, 1)]
    assert [w.gpu for w in workers if w.role == "drafter"] == [5, 6, 7]
    assert [w.rank for w in workers if w.role == "drafter"] == [0, 1, 2]
    assert [w.gpu for w in parse_gpu_spec("0+3:target,1-2:drafter")] == [0, 3, 1, 2]


def test_sharing_needs_the_flag():
    with pytest.raises(GpuSpecError, match="--share-gpus"):
        parse_gpu_spec("0:target,0:drafter", available=1)
    workers = parse_gpu_spec("0:target,0:drafter", available=1, share_gpus=True)
    assert [w.gpu for w in workers] == [0, 0]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("0-4:target,5-9:drafter", "GPU 8 does not exist"),
        ("0-1:target,1-2:drafter", "GPU 1 is given twice"),
        ("0:target,1:trainer", "unknown role 'trainer'"),
        ("0-3:target", "no drafter GPU"),
        ("0:drafter", "no target GPU"),
        ("x:target,1:drafter", "'x' is not a GPU number"),
        ("3-1:target,4:drafter", "empty or negative"),
        ("0,1:drafter", "did you mean 0+1:drafter?"),
        ("", "--gpus is empty"),
    ],
)
def test_bad_specs(spec, needle):
    with pytest.raises(GpuSpecError, match=None) as err:
        parse_gpu_spec(spec, available=8)
    assert needle in str(err.value)


@pytest.mark.processes
@pytest.mark.parametrize(
    "spec, needle",
    [
        ("0-1:target,1:drafter", "given twice"),
        ("0:target,1:painter", "unknown role"),
        ("0:target", "no drafter"),
    ],
)
def test_bad_spec_is_one_line_no_traceback(spec, needle):
    out = run_launcher("up", "--device", "cpu", "--gpus", spec)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.processes
def test_bad_config_key_is_one_line(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[drafter]\nlearning_rate = 1e-3\n")
    out = run_launcher("up", "--device", "cpu", "--gpus", "0:target,1:drafter", "--config", str(cfg))
    assert out.returncode == 2
    assert "drafter.learning_rate" in out.stderr and str(cfg) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.processes
def test_missing_model_is_named(tmp_path):
    out = run_launcher(
        "up", "--device", "cpu", "--gpus", "0:target,1:drafter", "--run-dir", str(tmp_path / "r"), "data.path=/x.jsonl"
    )
    assert out.returncode == 2 and "target.model_path" in out.stderr


@pytest.mark.processes
def test_probe_unreachable_returns_2_within_timeout():
    start = time.monotonic()
    out = run_launcher("probe", "tcp://127.0.0.1:9", "--timeout", "1.5")
    elapsed = time.monotonic() - start
    assert out.returncode == 2
    assert "no answer" in out.stdout
    assert elapsed < 10  # interpreter start plus the 1.5 s timeout, never a hang


@pytest.mark.processes
def test_launcher_never_imports_torch():
    code = (
        "import sys, launcher.cli, launcher.supervisor, launcher.regenerate, launcher.regen_record; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.processes
def test_units_for_one_host_of_a_two_host_spec(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[target]\nmodel_path = "/models/m"\n[data]\npath = "/data/d.jsonl"\n[transport]\nallow_plaintext = true\n'
    )
    spec = "0-1:target@10.0.0.1,0:drafter@10.0.0.2"
    out = run_launcher(
        "units",
        "--gpus",
        spec,
        "--host",
        "10.0.0.2",
        "--config",
        str(cfg),
        "--out",
        str(tmp_path / "units"),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert out.returncode == 0, out.stderr
    env_dir = tmp_path / "units" / "dflash-env"
    assert sorted(p.name for p in env_dir.glob("dflash-*@*.env")) == ["dflash-drafter@0.env"]  # only this host's
    env = (env_dir / "dflash-drafter@0.env").read_text()
    assert "DFLASH_HEALTH_ENDPOINT=tcp://10.0.0.2:" in env
    assert "MASTER_ADDR" not in env  # the drafters meet on rank 0's ipc store: no TCPStore on 10.0.0.2
    resolved = (env_dir / "config.json").read_text()  # installed with the env files, not into the run dir
    assert '"10.0.0.1"' in resolved and '"tcp"' in resolved  # workers reach the targets on host A
    missing = run_launcher(
        "units", "--gpus", spec, "--config", str(cfg), "--out", str(tmp_path / "u2"), "--run-dir", str(tmp_path / "r2")
    )
    assert missing.returncode == 2 and "--host" in missing.stderr


@pytest.mark.processes
def test_missing_model_folder_and_data_are_named(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(tmp_path / "r"),
        f"target.model_path={tmp_path / 'no-such-model'}",
        f"data.path={data}",
    )
    assert out.returncode == 2 and "no-such-model does not exist" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "m").mkdir()
    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(tmp_path / "r"),
        f"target.model_path={tmp_path / 'm'}",
        f"data.path={tmp_path / 'none.jsonl'}",
    )
    assert out.returncode == 2 and "data.path" in out.stderr and "none.jsonl" in out.stderr
    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(tmp_path / "r"),
        f"target.model_path={tmp_path / 'm'}",
        f"data.path={data}",
    )
    assert out.returncode == 2 and "no config.json" in out.stderr


@pytest.mark.processes
@pytest.mark.parametrize("ids", ["[2, 0]", "[1, 1]"])
def test_unsorted_or_repeated_layer_ids_are_refused_at_up(tmp_path, ids):
    """The target concatenates layers in ascending order and the export declares the configured list:
    any other order would export a drafter that engines feed wrongly, so `up` refuses it (exit 2)."""
    run_dir = tmp_path / "r"
    out = run_launcher(
        "up", "--device", "cpu", "--gpus", "0:target,1:drafter", "--run-dir", str(run_dir), f"target.layer_ids={ids}"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"target.layer_ids {ids} must be in ascending order without repeats" in out.stderr
    assert not run_dir.exists()  # refused before anything was written


@pytest.mark.processes
def test_probe_takes_a_socket_path_and_names_bad_endpoints_and_keys(tmp_path):
    import os

    from services.net.curve import generate_keys
    from services.process.health import HealthServer

    path = tmp_path / "sock" / "target-0.health"
    health = HealthServer(f"ipc://{path}", "target", 0, "cpu")
    try:
        health.set(state="ready")
        out = run_launcher("probe", str(path), "--timeout", "5")
        assert out.returncode == 0 and "ready" in out.stdout, out.stdout + out.stderr
    finally:
        health.close()
    out = run_launcher("probe", "target-0.health")
    assert out.returncode == 2 and "expected ipc://PATH, tcp://HOST:PORT or the path of a socket file" in out.stderr
    keys = tmp_path / "keys"
    generate_keys(keys)
    os.chmod(keys / "client.secret", 0o644)
    out = run_launcher("probe", "tcp://127.0.0.1:9", "--keys", str(keys))
    assert out.returncode == 2 and "client.secret is readable by others" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.processes
def test_plaintext_tcp_off_loopback_is_refused_and_on_loopback_warned(tmp_path):
    """Issue 19, 5: tcp without CURVE keys. Every run below stops at the missing model (exit 2) at the
    latest, before any worker or socket exists; what matters is what is said before that."""

    def up(host, *extra):
        return run_launcher(
            "up",
            "--device",
            "cpu",
            "--gpus",
            f"0:target@{host},1:drafter@{host}",
            "--host",
            host,
            "--run-dir",
            str(tmp_path / "r"),
            *extra,
        )

    out = up("10.0.0.1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "transport.scheme=tcp on 10.0.0.1 without transport.curve_keys_dir" in out.stderr
    assert "transport.allow_plaintext=true" in out.stderr and not (tmp_path / "r").exists()

    allowed = up("10.0.0.1", "transport.allow_plaintext=true")  # said explicitly: runs, with a warning
    assert "warning: plaintext tcp on 10.0.0.1" in allowed.stderr and "target.model_path is not set" in allowed.stderr
    loopback = up("127.0.0.1")
    assert "warning: plaintext tcp on 127.0.0.1" in loopback.stderr, loopback.stderr
    assert "target.model_path is not set" in loopback.stderr
    keys = up("10.0.0.1", f"transport.curve_keys_dir={tmp_path / 'keys'}")
    assert "plaintext" not in keys.stderr and "target.model_path is not set" in keys.stderr, keys.stderr


def test_keys_given_by_their_old_names_work_and_up_says_where_they_are_now(tmp_path):
    """One note line naming each old key (the file's and the overrides'), and the run goes on to the
    next check (here: the missing model, exit 2)."""
    from services.run.config import old_names_used

    config = tmp_path / "old.toml"
    config.write_text("[run]\ncheckpoint_every = 5\n[drafter]\nlr = 1e-3\nnum_layers = 2\n")
    assert old_names_used(config, ["drafter.compile=false", "data.pack_len=256"]) == [
        "run.checkpoint_every -> checkpoint.every",
        "drafter.lr -> optimizer.lr",
        "drafter.compile -> kernels.compile",
    ]
    assert old_names_used(None, ["checkpoint.every=5"]) == []
    out = run_launcher(
        "up", "--device", "cpu", "--gpus", "0:target,1:drafter", "--config", config, "--run-dir", tmp_path / "r",
        "drafter.compile=false",
    )  # fmt: skip
    assert out.returncode == 2 and "target.model_path is not set" in out.stderr, out.stderr
    (note,) = [line for line in out.stderr.splitlines() if "old names" in line]
    assert "run.checkpoint_every -> checkpoint.every" in note and "drafter.compile -> kernels.compile" in note


@pytest.mark.processes
def test_demo_takes_an_optional_variant_and_names_a_bad_one():
    from launcher.parser import build_parser
    from services.process.jobs import DEMO_VARIANTS
    from services.tools.demo import VARIANTS

    assert DEMO_VARIANTS is VARIANTS  # one list, in services/process/jobs.py (the launcher never imports torch)
    parser = build_parser()
    demo = lambda *argv: parser.parse_args(["up", "--gpus", "0:target", *argv]).demo  # noqa: E731
    assert demo("--demo") == demo("--demo", "dense") == "dense" and demo("--demo", "hybrid") == "hybrid"
    assert demo() is None and demo("--demo", "--device", "cpu") == "dense"
    out = run_launcher("up", "--demo", "moe", "--gpus", "0:target,1:drafter", "--device", "cpu")
    assert out.returncode == 2 and "argument --demo: invalid choice: 'moe'" in out.stderr


@pytest.mark.processes
def test_plaintext_is_refused_for_a_rank_past_the_host_lists(tmp_path):
    """The check reads the endpoints every rank will bind: target-1 is past target_hosts, so it binds
    transport.host. Refused (exit 2, one line naming that endpoint) before any run dir or socket exists."""
    from services.net.endpoints import endpoint
    from services.run.config import load_config

    out = run_launcher(
        "up",
        "--device",
        "cpu",
        "--gpus",
        "0-1:target,2:drafter",
        "--run-dir",
        str(tmp_path / "r"),
        "transport.scheme=tcp",
        'transport.target_hosts=["127.0.0.1"]',
        'transport.drafter_hosts=["127.0.0.1"]',
        "transport.host=10.77.0.1",
    )
    plain = ["transport.scheme=tcp", "transport.host=10.77.0.1", "transport.allow_plaintext=true"]
    bound = endpoint(tmp_path, load_config(None, plain).transport, "target", 1, "health")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert f"target-1 would bind {bound} in plaintext (and 1 more sockets off loopback)" in out.stderr, out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.processes
def test_eval_of_a_runs_checkpoint_reads_that_runs_config(tmp_path):
    """`launcher eval --checkpoint RUN/checkpoints/step-N` (or RUN, or RUN/export) from anywhere takes
    RUN's config; before, it looked for runs/latest under the working directory."""
    from services.run.config import Config, dump_json

    run, cwd = tmp_path / "run", tmp_path / "elsewhere"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "export").mkdir()
    cwd.mkdir()
    dump_json(Config(), run / "config.json")
    (run / "run.json").write_text("{}")
    for checkpoint in (run / "checkpoints" / "step-00000001", run / "export"):
        out = run_launcher("eval", "--checkpoint", str(checkpoint), "--device", "cpu", timeout=120, cwd=cwd)
        assert out.returncode == 2
        assert f"eval: error: {checkpoint}: not a checkpoint (no manifest.json)" in out.stderr  # past the config
    out = run_launcher("eval", "--device", "cpu", timeout=120, cwd=cwd)
    assert out.returncode == 2 and "config file not found: runs/latest/config.json" in out.stderr


def _subcommands() -> dict:
    from launcher.parser import build_parser

    return build_parser()._subparsers._group_actions[0].choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_commands_help_opens_with_what_it_does_and_shows_defaults(command, capsys):
    """`launcher CMD --help`: usage, then a paragraph saying what CMD does, then the options; every
    option that has a default (0 included: regenerate --temperature) says it."""
    from launcher.cli import main
    from launcher.parser import _shown_default

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    paragraphs = capsys.readouterr().out.split("\n\n")
    assert paragraphs[0].startswith(f"usage: launcher {command}")
    description = paragraphs[1].strip()
    assert description.endswith("."), description
    assert not description.startswith(("options:", "positional arguments:")), description
    parser = _subcommands()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help is not None and _shown_default(action.default):
            assert "default" in formatter._get_help_string(action), (command, action.option_strings)


def test_zero_defaults_are_shown(capsys):
    from launcher.cli import main

    with pytest.raises(SystemExit):
        main(["regenerate", "--help"])
    assert "0 = greedy (default: 0.0)" in capsys.readouterr().out
