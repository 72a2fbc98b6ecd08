"""`launcher eval`'s options are declared once (services/run/eval_options.py): what the user gives the
launcher reaches the evaluation's own parser unchanged."""

import argparse

import pytest

from launcher.parser import build_parser
from services.run import eval_options


def child_parser(options=eval_options.EVAL_OPTIONS) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    eval_options.add(p, options)
    return p


@pytest.mark.parametrize(
    "given",
    [
        [],
        ["--checkpoint", "a", "--checkpoint=b c", "--prompts", "x.jsonl", "--prompts", "y.jsonl.gz"],
        ["--limit", "8", "--max-new-tokens", "64", "--batch", "16", "--device", "cuda:1", "--no-controls"],
        ["--eval-device", "cpu", "--set", 'target.model_path="m"', "--set", "target.quantize=none", "--json"],
        ["--threads", "4", "--rollback", "refeed", "--run-dir", "runs/x", "--prompts", "12"],
        ["--speedup-prompts", "4", "--device", "cpu"],
        ["--speedup-prompts=0"],
    ],
)
def test_what_the_launcher_takes_reaches_the_evaluation_as_given(given):
    args = build_parser().parse_args(["eval", *given])
    forwarded = eval_options.forward(args)
    child = vars(child_parser().parse_args(forwarded))
    assert child == {k: v for k, v in vars(args).items() if k in child}
    assert len(child) == len(eval_options.EVAL_OPTIONS)  # every option has its place in the child's namespace
    assert not [a for a in forwarded if a in ("--eval-device",)]  # one spelling goes on, the first


def test_report_eval_hands_on_its_prompt_options_only():
    args = build_parser().parse_args(["report", "--eval", "--prompts", "p.jsonl", "--limit", "3", "--device", "cpu"])
    forwarded = eval_options.forward(args, eval_options.PROMPT_OPTIONS)
    assert forwarded == ["--prompts=p.jsonl", "--limit=3", "--device=cpu"]
    assert vars(child_parser().parse_args(forwarded))["limit"] == 3
