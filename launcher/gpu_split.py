"""`launcher plan`: how to split N GPUs between the roles, from what one GPU does in each.

The measurement runs in a child process (services/tools/measure_roles.py: torch stays out of the
launcher); the split is plain arithmetic. With T target GPUs and N - T drafter GPUs on separate GPUs, the
service trains min(T x A, (N - T) x B) tokens per second: the slower side bounds it
(docs/benchmarks.md measured the service at 0.99-1.01 of that bound on one and two H200s).
"""

from __future__ import annotations

import json
import subprocess

from services.process import jobs


def splits(num_gpus: int, a: float, b: float) -> list[dict]:
    """Every split with at least one GPU per role: its expected tok/s and which role bounds it."""
    rows = []
    for t in range(1, num_gpus):
        supply, demand = t * a, (num_gpus - t) * b
        rows.append(
            {
                "targets": t,
                "drafters": num_gpus - t,
                "tok_s": min(supply, demand),
                "bound": "target" if supply < demand else "drafter",
                "target_busy": min(1.0, demand / supply),
                "drafter_busy": min(1.0, supply / demand),
            }
        )
    return rows


def best(rows: list[dict]) -> dict:
    """The fastest split; among equals, the one with more drafters (drafters scale the model size)."""
    return max(rows, key=lambda r: (round(r["tok_s"], 6), r["drafters"]))


def measure(config: str | None, device: str, seconds: float, overrides: list[str]) -> dict:
    cmd = [
        *jobs.argv("measure-roles"),
        "--device",
        device,
        "--seconds",
        str(seconds),
        *overrides,
    ]
    if config:
        cmd[3:3] = ["--config", config]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"measuring failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_gpus(text: str) -> list[int]:
    """`plan --gpus`: a count (8: GPUs 0-7), GPU numbers (0-7, 0-3+6) or an `up` spec
    (0-4:target,5-7:drafter: its GPUs, whatever the roles). ValueError naming what is wrong."""
    from launcher.topology import GpuSpecError, _parse_gpus, parse_gpu_spec

    text = text.strip()
    if text.isdigit():
        gpus = list(range(int(text)))
    elif "@" in text:
        raise ValueError(f"--gpus {text}: plan measures one host; give this host's GPUs without @HOST")
    else:
        try:
            gpus = sorted(
                {w.gpu for w in parse_gpu_spec(text, share_gpus=True)} if ":" in text else set(_parse_gpus(text, text))
            )
        except GpuSpecError as exc:
            raise ValueError(str(exc)) from None
    if len(gpus) < 2:
        raise ValueError(f"--gpus {text}: a split needs at least 2 GPUs")
    return gpus


def describe(measured: dict, gpus: list[int]) -> str:
    a, b = measured["target"]["tok_s"], measured["drafter"]["tok_s"]
    num_gpus = len(gpus)
    rows = splits(num_gpus, a, b)
    pick = best(rows)
    lines = [
        f"one {measured['device']}: target {a:,.0f} tok/s ({measured['target']['path']} capture, "
        f"{measured['target']['mean_real_tokens']:.0f} real tokens per row), drafter {b:,.0f} tok/s "
        f"({measured['drafter']['step_s'] * 1000:.0f} ms a step)",
        f"{'split':>8}  {'expected tok/s':>14}  bound by   target busy  drafter busy",
    ]
    for r in rows:
        mark = "  <- best" if r is pick else ""
        lines.append(
            f"{r['targets']:>3}:{r['drafters']:<4}  {r['tok_s']:>14,.0f}  {r['bound']:<9}  "
            f"{r['target_busy']:>10.0%}  {r['drafter_busy']:>11.0%}{mark}"
        )
    t = pick["targets"]
    lines.append(f"use: --gpus {_spec(gpus[:t])}:target,{_spec(gpus[t:])}:drafter")
    return "\n".join(lines)


def _spec(gpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2+5'."""
    runs: list[list[int]] = []
    for gpu in gpus:
        if runs and gpu == runs[-1][-1] + 1:
            runs[-1].append(gpu)
        else:
            runs.append([gpu])
    return "+".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
