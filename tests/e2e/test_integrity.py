"""Nothing wrong reaches the weights, on the CPU demo with real processes: a same-uid process that
takes a target's socket over and replays its incarnation gets none of its batches trained, and
the held-out eval does not wait for it; a target with inf in its weights stops the run with an
error naming it and the captured layer, and nothing non-finite is saved. An `error` claimed for a
batch that exists (no real process needed): tests/unit/test_cores.py."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.cli import main as launcher_main
from launcher.drops import describe_drops
from tests.e2e.test_launcher_demo import assert_exactly_once, assert_no_worker_left, launcher, metrics
from tests.launching import PLUMBING, REPO, child_env, wait_for


def impostor(run_dir: str, report: str, go: str) -> None:
    """Run as its own process, started with the launcher: fetch batch 0 of both splits from target-0 as
    a drafter would and say so (`report`: armed), then wait for the test's go (the file `go`). At go,
    SIGKILL target-0, bind its data socket at once and answer every batch request with batch 0's real
    frames relabelled as the batch asked for, under the killed target's own incarnation.

    Arming first keeps the slow part (interpreter, imports, two batches from a busy target) out of the
    race with training: started only once the drafters trained, it took over after their last batch
    on a slow machine, and no drafter ever asked it (the CPU run trains 100 steps in ~10 s)."""
    from services.net.batch_client import BatchArrived, BatchClient
    from services.net.endpoints import endpoint
    from services.net.health_probe import probe
    from services.net.transport import BatchServer
    from services.run.config import load_config
    from services.run.files import write_json_atomic

    run = Path(run_dir)
    while not (run / "config.json").exists():  # the run dir appears whole (launcher/preflight.py staged)
        time.sleep(0.2)
    cfg = load_config(run / "config.json")
    data, health = (endpoint(run, cfg.transport, "target", 0, p) for p in ("data", "health"))
    status = None
    while not (status and status.get("state") in ("ready", "training") and status.get("incarnation")):
        time.sleep(0.2)  # still loading: its data socket is bound once it is ready
        _, status, _ = probe(health, timeout_s=1.0)
    incarnation, pid = status["incarnation"], status["pid"]
    client = BatchClient([data], cfg.transport)
    real = {}
    for split in ("train", "eval"):
        client.request(0, 0, split, incarnation=incarnation)
    while len(real) < 2:
        real.update({e.split: e.batch for e in client.poll(200) if isinstance(e, BatchArrived)})
    client.close()
    answered: dict[str, list[int]] = {"train": [], "eval": []}
    said = {"armed": True, "killed": None, "incarnation": incarnation, "answered": answered}
    write_json_atomic(Path(report), said)  # atomic: the test reads it while this runs
    while not Path(go).exists():
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    server = BatchServer(data, cfg.transport)
    server.incarnation = incarnation  # the killed target's, as it announced it
    said["killed"] = pid
    write_json_atomic(Path(report), said)
    while True:
        for request in server.poll(100):
            if request.kind == "batch":
                server.send_batch(request.client, dataclasses.replace(real[request.split], g=request.g), request.split)
                answered[request.split].append(request.g)
                write_json_atomic(Path(report), said)


@pytest.mark.training
def test_a_same_uid_takeover_replaying_the_incarnation_trains_nothing_and_does_not_stall_the_eval():
    from services.data.batch import token_digest
    from services.data.packed_data import PackedData, RowOrder
    from services.drafter.books.ledger import read_all
    from services.run.config import load_config

    with tempfile.TemporaryDirectory(prefix="i25", dir="/tmp") as folder:  # short: ipc paths < 108 bytes
        run_dir, log, report = Path(folder) / "run", Path(folder) / "out.txt", Path(folder) / "impostor.json"
        go = Path(folder) / "go"  # made by the test: the impostor takes over now
        with open(log, "w") as out:
            proc = subprocess.Popen(
                launcher(  # its own packed data: the test reads the run's one cache file
                    run_dir,
                    *PLUMBING,
                    "run.max_steps=100",
                    "eval.every=8",
                    "checkpoint.every=0",
                    "transport.credits=4",
                    # re-ask unanswered requests soon: the derived wait (10 s at least) outlasts the
                    # launcher's restart of target-0, so the impostor could go unasked
                    "transport.resend_after_s=2",
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        fake = None
        try:
            fake = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from tests.e2e.test_integrity import impostor; impostor(*sys.argv[1:])",
                    str(run_dir),
                    str(report),
                    str(go),
                ],
                cwd=REPO,
                env=child_env(),
            )

            def said() -> dict:
                assert fake.poll() is None, f"the impostor exited with code {fake.returncode}"
                return json.loads(report.read_text()) if report.exists() else {}

            # go once the drafters train (handshakes done), whatever the machine's speed: ~90 steps of
            # batches are left, all target-0's, so they ask whoever holds its socket: at once, or at the
            # 2 s resend if a request was lost, before the relaunched target-0 binds it (1 s + its loading)
            wait_for(lambda: said().get("armed"), "the impostor to fetch batch 0 from target-0", proc)
            wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 1, "training", proc)
            go.touch()
            wait_for(
                lambda: said()["answered"]["train"],
                "a drafter to ask the impostor for a training batch (else the test proves nothing)",
                proc,
                timeout_s=120,
            )
            proc.wait(timeout=900)
        finally:
            for p in (proc, fake):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
        text = log.read_text()
        assert proc.returncode == 0, text[-3000:]
        took_over = json.loads(report.read_text())
        answered = took_over["answered"]
        assert answered["train"], f"no drafter asked the impostor for a batch: the test proves nothing ({took_over})"

        # every batch trained is the batch the data says: no relabelled batch 0 reached the weights
        cfg = load_config(run_dir / "config.json")
        (cache,) = [p for p in (run_dir / "data-cache").glob("*.safetensors") if ".digests." not in p.name]
        data = PackedData(cache, RowOrder.from_config(cfg))
        entries = [e for e in read_all(run_dir) if e["tokens"]]
        wrong = [
            (e["g"], e["incarnation"]) for e in entries if e["digest"] != token_digest(data.batch(e["g"])["input_ids"])
        ]
        assert not wrong, f"{len(wrong)} trained batches whose tokens are not batch g's (g, incarnation): {wrong[:5]}"
        assert_exactly_once(run_dir)

        # the impostor's answers were dropped and counted as content, with the incarnation it claimed
        logs = "".join((run_dir / "logs" / f"drafter-{r}.log").read_text() for r in (0, 1))
        assert "dropped a bad data-content message" in logs and took_over["incarnation"] in logs, logs[-3000:]

        # ... and the launcher said so: a warning while it ran, the totals at the end and in run.json's outcome
        outcome = json.loads((run_dir / "run.json").read_text())["outcome"]
        dropped = {name: kinds for name, kinds in outcome.get("dropped", {}).items() if kinds.get("data-content")}
        assert dropped and all(outcome["dropped_from"][name] == ["target-0"] for name in dropped), outcome
        for name, kinds in dropped.items():
            assert re.search(
                rf"^warning: {name} dropped \d+ answers \(.*data-content \d+.*\): another process "
                rf"answered for target-0 \(see logs/{name}.log\)$",
                text,
                re.M,
            ), text[-3000:]
            assert f"warning: {describe_drops(name, kinds, ['target-0'])}\n" in text, text[-3000:]  # the totals
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            launcher_main(["status", "--run-dir", str(run_dir), "--timeout", "0.5"])
        for name, kinds in dropped.items():
            assert f"warning: {describe_drops(name, kinds, ['target-0'])}" in stdout.getvalue(), stdout.getvalue()

        # the held-out evaluation did not wait for the impostor
        evals = [
            json.loads(line)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("eval")
        ]
        assert evals and max(e["eval_s"] for e in evals) < 30, [e["eval_s"] for e in evals]
        # nor did training: no logged window waited for data that long
        waits = [m["time_data_s"] for m in metrics(run_dir) if "time_data_s" in m and not m.get("eval")]
        assert not waits or max(waits) < 30, sorted(waits)[-5:]
        assert_no_worker_left(run_dir)


def poisoned_demo_target(out: Path, layer: int) -> Path:
    """A copy of the demo's (real, tiny) target with inf in one decoder layer's MLP weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from services.tools.demo import cache_dir, make_demo

    model = Path(make_demo(cache_dir())["model_path"])
    shutil.copytree(model, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


@pytest.mark.training
def test_a_target_with_inf_weights_stops_the_run_naming_it_and_nothing_non_finite_is_saved():
    """Layer 1 of the target is poisoned; captured layers 0 and 2: layer 0's features are finite,
    layer 2's are not. Every step is skipped, `launcher status` counts it, the run ends with an
    error naming the target and the layer, and every checkpoint on disk is finite. A restart would
    skip the same steps again: the drafters exit 4 (final), and the run fails at once with its
    restart budget (supervise.max_restarts=3) untouched."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="i25p", dir="/tmp") as folder:
        folder = Path(folder)
        model = poisoned_demo_target(folder / "poisoned", layer=1)
        run_dir, log = folder / "run", folder / "out.txt"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                launcher(
                    run_dir,
                    *PLUMBING,
                    f'target.model_path="{model}"',
                    "target.layer_ids=[0,2]",
                    "supervise.max_restarts=3",
                    "optimizer.max_nonfinite_steps=12",
                    "checkpoint.every=4",
                    "run.epochs=1",
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        seen = ended = None
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if seen is None and (run_dir / "run.json").is_file():
                    # in this process: the run lasts only 12 skipped steps, a fresh interpreter per poll
                    # (about a second each) could miss it on a loaded machine
                    stdout = io.StringIO()
                    with contextlib.redirect_stdout(stdout):
                        launcher_main(["status", "--run-dir", str(run_dir), "--json"])
                    try:
                        rows = json.loads(stdout.getvalue())["workers"]
                    except ValueError:
                        rows = []
                    counts = [r.get("integrity") or {} for r in rows if r["name"].startswith("drafter")]
                    if counts and all(c.get("nonfinite_batches", 0) >= 1 for c in counts):
                        seen = counts
                time.sleep(0.1)
            ended = time.time()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        text = log.read_text()
        assert proc.returncode == 1 and "restarting in" not in text, text[-3000:]
        record = json.loads((run_dir / "run.json").read_text())
        assert record["restarts"] == {"target": 0, "drafter": 0}, record["restarts"]
        reason = record["outcome"]["reason"]
        assert (
            record["outcome"]["state"] == "failed"
            and "exited with code 4" in reason
            and "NonFiniteError" in reason
            and "captured layer 2 from target-0" in reason
            and "a restart would meet the same error" in reason
        ), reason
        assert f"exit 1 (failed: {reason})" in text, text[-3000:]
        # the launcher ended the run within seconds of the first bad batch (a group restart: a minute more)
        bad = [
            line
            for r in (0, 1)
            for line in (run_dir / "logs" / f"drafter-{r}.log").read_text().splitlines()
            if " warning skipped batch g=" in line
        ]
        first_bad = min(
            datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp() for line in bad
        )
        assert ended - first_bad < 20, f"the run ended {ended - first_bad:.0f}s after the first bad batch"
        assert seen and all(c["skipped_steps"] >= 1 and "captured layer 2" in c["last_nonfinite"] for c in seen), seen
        last_lines = [(run_dir / "logs" / f"drafter-{r}.log").read_text().strip().splitlines()[-1] for r in (0, 1)]
        for line in last_lines:
            assert "NonFiniteError: 12 optimizer steps in a row skipped" in line, last_lines
            assert "non-finite hidden states of captured layer 2 from target-0" in line, last_lines
        assert not (run_dir / "export").exists()
        saved = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
        assert saved, "no checkpoint was written while the steps were skipped"
        for path in saved:
            assert all(bool(t.isfinite().all()) for t in load_file(str(path)).values()), path
