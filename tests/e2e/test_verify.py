"""A real target worker process killed and restarted mid-eval (services/net/verify.py, target/verifying.py,
drafter/acceptance/remote_eval.py), on the demo's tiny dense Qwen3, random weights, fp32 on CPU: it costs a
retried or skipped prompt, never a hang; the eval goes on with the new incarnation, losslessly.
The verify scenarios that need no real process (lossless through the worker on dense and hybrid
targets, hostile messages, controls, prompt sets): tests/unit/test_verify_inprocess.py.
"""

from __future__ import annotations

import signal
import time

import pytest

from services.drafter.modeling.target_head import from_target
from services.net.verify import SessionLost, TargetUnavailable
from services.net.verify_client import VerifyClient
from services.run import runspec
from tests.assets import random_demo
from tests.verify_targets import TargetProcess, remote_spec_eval, verify_overrides

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return random_demo()


def test_a_target_restarted_mid_eval_costs_a_prompt_never_a_hang(demo, tmp_path):
    w = TargetProcess(tmp_path / "run", verify_overrides(demo, demo["model_path"]))
    first = w.start()
    cfg = w.cfg
    model_cfg, head = from_target(runspec.resolve(cfg))
    client = VerifyClient([w.data_ep], [w.health_ep], cfg.transport, width=128, timeout_s=10)
    try:
        reply = client.open(0, 1, [5, 6, 7, 8])
        assert reply.features.shape == (4, 128)
        w.stop(signal.SIGKILL)
        second = w.start()  # a new incarnation on the same endpoint
        assert second["incarnation"] != first["incarnation"]
        start = time.monotonic()
        with pytest.raises((SessionLost, TargetUnavailable)):  # the session lived in the old process
            client.step(0, 1, [reply.greedy[-1], 1, 2, 3])
        assert time.monotonic() - start < 15
        # the eval goes on with the new incarnation
        spec = remote_spec_eval(cfg, w.run_dir, 1, head, model_cfg, prompts=2, max_new_tokens=6)
        result = spec.run(spec.proposer(None, model_cfg))
        assert result["prompts"] == 2 and result["skipped"] == 0 and result["lossless"] == 2
        # with the target gone, the eval skips its prompts at once
        w.stop(signal.SIGKILL)
        start = time.monotonic()
        spec._refs.clear()
        gone = spec.run(spec.proposer(None, model_cfg))
        assert gone["prompts"] == 0 and gone["skipped"] >= 1 and time.monotonic() - start < 30
        spec.close()
    finally:
        client.close()
        w.stop(signal.SIGKILL)
