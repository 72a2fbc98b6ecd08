"""Targets for the verify tests: a tiny random Qwen3.5 hybrid beside the demo's dense target, the
overrides that size a verify run, a target worker process, and a drafter that is mostly right.
The tests: tests/unit/test_verify_inprocess.py (a target in the test's interpreter, tests/inprocess.py)
and tests/e2e/test_verify.py (a real target process, killed and restarted)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import torch

from services.drafter.acceptance.remote_eval import RemoteEvalSettings, RemoteSpecEval
from services.net.endpoints import endpoint
from services.net.health_probe import probe
from services.run.config import load_config
from services.run.placement import Placement
from tests.launching import REPO, target_argv
from tests.tiny_targets import tiny_hybrid_config

PROMPTS, NEW = 3, 12


def hybrid_model(demo, out: Path) -> str:
    """A tiny random Qwen3.5 hybrid with the demo's tokenizer, saved like a checkpoint."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(demo["model_path"])
    torch.manual_seed(0)
    types = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    cfg = tiny_hybrid_config(types, len(tokenizer), max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a spread of logits: greedy output is not one token repeated
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


class TargetProcess:
    """A target worker process on a run dir, and its endpoints."""

    def __init__(self, run_dir: Path, overrides: list[str]):
        self.run_dir, self.overrides = run_dir, overrides
        self.cfg = load_config(None, overrides)
        self.health_ep = endpoint(run_dir, self.cfg.transport, "target", 0, "health")
        self.data_ep = endpoint(run_dir, self.cfg.transport, "target", 0, "data")
        self.proc = None

    def start(self) -> dict:
        self.proc = subprocess.Popen(
            target_argv(self.run_dir, *self.overrides),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.wait_ready()

    def wait_ready(self, timeout=120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            _, status, _ = probe(self.health_ep, timeout_s=1.0)
            if status and status["state"] in ("ready", "training"):
                return status
            time.sleep(0.2)
        raise AssertionError("the target worker did not get ready")

    def status(self) -> dict:
        _, status, _ = probe(self.health_ep, timeout_s=5.0)
        return status

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


def verify_overrides(demo, model_path: str) -> list[str]:
    return demo["overrides"] + [
        f'target.model_path="{model_path}"',
        "data.pack_len=256",
        f"eval.max_new_tokens={NEW}",
        "drafter.block_size=4",
    ]


class MostlyRight:
    """A 'trained' drafter: drafts the target's greedy continuation (the reference) with one wrong
    token at the end of every block, so each step commits B-1 tokens."""

    def __init__(self, spec_eval: RemoteSpecEval, block_size: int):
        self.spec_eval, self.block_size, self.sequence = spec_eval, block_size, None

    def __call__(self, features, last_token, start):
        for i, prompt in enumerate(self.spec_eval.prompts):  # a prompt's first step: find its sequence
            ref = self.spec_eval._refs.get(i)
            if ref is not None and start == len(prompt) and last_token == ref.tokens[0]:
                self.sequence = prompt + ref.tokens
        drafts = (self.sequence[start + 1 : start + self.block_size] + [0] * self.block_size)[: self.block_size - 1]
        drafts[-1] = (drafts[-1] + 1) % 100
        return torch.tensor(drafts, device=features.device)

    def many(self, contexts, last_tokens) -> list[list[int]]:
        """Every prompt's block at once (the rows the target verifies together): each context's
        prompt is the one whose greedy sequence has the last token at the context's length."""
        out = []
        for context, last in zip(contexts, last_tokens):
            start = context.shape[0]
            for i, prompt in enumerate(self.spec_eval.prompts):
                sequence = prompt + self.spec_eval._refs[i].tokens
                if len(prompt) <= start < len(sequence) and sequence[start] == last:
                    self.sequence = sequence
                    break
            out.append(self(context, last, start).tolist())
        return out


def remote_spec_eval(cfg, run_dir, num_targets: int, head, model_cfg, **options) -> RemoteSpecEval:
    """Drafter rank 0's real-acceptance eval of a run, verified by its num_targets target workers."""
    at = Placement(run_dir, "drafter", num_targets=num_targets)
    return RemoteSpecEval(RemoteEvalSettings.from_config(cfg, at), head, model_cfg, None, **options)
