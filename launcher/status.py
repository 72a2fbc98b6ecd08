"""`launcher status`: probe every worker of a run in parallel and print one table (or --json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from launcher import process
from launcher.drops import describe_drops
from launcher.progress import describe_acceptance, describe_window
from launcher.report import describe_data, read_acceptance_lines
from launcher.rundir import OUTCOME_EXIT, describe_live, describe_outcome, read_run
from launcher.supervisor import probe_all
from services.run.schedule import Plan

STATUS_COLUMNS = (
    "name",
    "gpu",
    "pid",
    "state",
    "step",
    "batches",
    "tok/s",
    "samples",
    "idle_s",
    "rss",
    "gpu_mem",
    "bad_msgs",
    "probe",
)
STATUS_LEGEND = """\
step     drafters: optimizer steps done / planned
batches  targets: batches captured and sent since the worker started
tok/s    drafters: tokens this rank trained per second over the last metrics window;
         targets: tokens captured per second of capture (moving average)
idle_s   seconds since the worker's main loop last made progress
(samples, rss, gpu_mem, bad_msgs, probe, τ, cov: docs/guide/monitoring.md#glossary)"""


def cmd_status(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    run = read_run(run_dir)
    results = probe_all([w["endpoints"]["health"] for w in run["workers"]], args.timeout, _run_keys(run_dir))
    rows = [_row(w, r) for w, r in zip(run["workers"], results)]
    plan = _read_plan(run_dir)
    live = process.alive(run.get("launcher"))
    outcome = describe_outcome(run, live)
    # no worker answers (an ended run, drafters down): the last line of metrics.jsonl, as they would report it
    window = next((r["window"] for r in rows if r.get("window")), None) or last_window(run_dir)
    acceptance = next((r["acceptance"] for r in rows if r.get("acceptance")), None) or last_acceptance(run_dir)
    agents = elastic_agents(run_dir)  # a drafter group across hosts: this host's agent (docs/elastic.md)
    if args.json:
        print(
            json.dumps(
                {
                    "run_dir": str(run_dir),
                    "launcher_pid": run["launcher_pid"],
                    "launcher_alive": live,
                    "outcome": run.get("outcome"),
                    "window": window,
                    "acceptance": acceptance,
                    "plan": plan.to_dict() if plan else None,
                    "elastic": agents,
                    "workers": rows,
                },
                indent=2,
            )
        )
    else:
        print(f"run {run_dir}: {outcome}")
        table = [STATUS_COLUMNS] + [_cells(r) for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(STATUS_COLUMNS))]
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
        print(STATUS_LEGEND)
        if window:
            print(
                f"metrics {describe_window(window)}, data wait {100 * window['data_wait_frac']:.0f}% "
                f"(the metrics.jsonl line of that step)"
            )
        if acceptance:
            print(describe_acceptance(acceptance))
        for off in dict.fromkeys(r["real_acceptance_off"] for r in rows if r.get("real_acceptance_off")):
            print(f"warning: {off}")
        for r in rows:
            if r.get("warning"):
                print(f"{r['name']}: warning: {r['warning']}")
            if (integrity := r.get("integrity") or {}).get("nonfinite_batches") or integrity.get("skipped_steps"):
                print(
                    f"{r['name']}: {integrity['nonfinite_batches']} non-finite batches skipped, "
                    f"{integrity['skipped_steps']} "
                    f"optimizer steps skipped; last: {integrity['last_nonfinite'] or 'another rank'}"
                )
        _print_drops(rows, run.get("outcome") or {}, live)
        for agent in agents:
            print(
                f"drafter agent on {agent.get('host')} (ranks {agent.get('ranks')}): {agent.get('state')}, "
                f"{agent.get('restarts', 0)} group restart(s)" + (f"; {agent['reason']}" if agent.get("reason") else "")
            )
        _print_last_exits(rows)
        if plan:
            print(f"plan: {plan.describe()}")
        if (run_dir / "data.json").is_file():
            print(describe_data(json.loads((run_dir / "data.json").read_text())))
        print(f"launcher pid {run['launcher_pid']} {'alive' if live else 'not running'}")
        if not live:
            print(describe_live(run_dir.parent, run_dir))
    state = (run.get("outcome") or {}).get("state")
    if not live and state in OUTCOME_EXIT:
        return OUTCOME_EXIT[state]  # an ended run: its own exit code, not "every worker unreachable"
    return max((r["probe"] for r in rows), default=0)


def elastic_agents(run_dir: Path) -> list[dict]:
    """What each elastic agent of this run dir last wrote (services/drafter/group/agent.py): state, restarts."""
    found = []
    for path in sorted((run_dir / "elastic").glob("agent-*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def last_window(run_dir: Path) -> dict | None:
    """The last train line of <run_dir>/metrics.jsonl in the form of a drafter's health `window`."""
    from launcher.report import ReportError, read_metrics

    try:
        train, _ = read_metrics(run_dir)
    except (ReportError, OSError):
        return None
    if not train:
        return None
    last = train[-1]
    try:
        window = {k: last.get(k) for k in ("step", "loss", "tau", "coverage", "tokens_per_s", "data_wait_frac")}
        window["steps"] = last["step"] - train[-2]["step"] if len(train) > 1 else last["step"]
        if "base_tau" in last:  # a Domino drafter
            window["base_tau"] = last["base_tau"]
        float(window["loss"]), float(window["tau"]), float(window["tokens_per_s"])
    except (KeyError, TypeError, ValueError):
        return None
    window["data_wait_frac"] = window["data_wait_frac"] or 0.0
    return window


def last_acceptance(run_dir: Path) -> dict | None:
    """The last real-acceptance line of training (acceptance.jsonl, not the final one) where no drafter
    answers: the figures its health carried."""
    during = [r for r in read_acceptance_lines(run_dir)[0] if not r.get("final")]
    return during[-1] if during else None


def _run_keys(run_dir: Path) -> str:
    """CURVE keys of a run (tcp with transport.curve_keys_dir), from its resolved config."""
    try:
        transport = json.loads((run_dir / "config.json").read_text())["transport"]
    except (OSError, ValueError, KeyError):
        return ""
    return transport.get("curve_keys_dir", "") if transport.get("scheme") == "tcp" else ""


def _row(w: dict, result: tuple[int, dict | None, str]) -> dict:
    code, status, reason = result
    row = {
        "name": w["name"],
        "gpu": w["gpu"],
        "pid": w["pid"],
        "probe": code,
        "reason": reason,
        "last_exit": w.get("last_exit"),
    }
    if status:
        row.update(
            {
                k: status.get(k)
                for k in (
                    "state",
                    "step",
                    "total_steps",
                    "batches_served",
                    "samples_done",
                    "tokens_per_s",
                    "last_progress_age_s",
                    "compile_s",
                    "rss_bytes",
                    "gpu_mem_bytes",
                    "gpu_reserved_bytes",
                    "bad_messages",
                    "loss",
                    "tau",
                    "window",
                    "warning",
                    "bad_message_kinds",
                    "bad_message_from",
                    "integrity",
                    "content_check",
                    "acceptance",
                    "real_acceptance_off",
                )
            }
        )
    return row


def _cells(r: dict) -> tuple[str, ...]:
    drafter = r["name"].startswith("drafter")
    step = f"{r['step']}/{r.get('total_steps') or '?'}" if drafter and r.get("step") is not None else "-"
    return (
        r["name"],
        str(r["gpu"]),
        _cell(r["pid"]),
        _cell(r.get("state")),
        step,
        "-" if drafter else _cell(r.get("batches_served")),
        _cell(r.get("tokens_per_s")),
        _cell(r.get("samples_done")),
        _cell(r.get("last_progress_age_s")),
        _cell(r.get("rss_bytes")),
        _cell(r.get("gpu_mem_bytes")),
        _cell(r.get("bad_messages")),
        str(r["probe"]),
    )


def _print_drops(rows: list[dict], outcome: dict, live: bool) -> None:
    """Messages a worker dropped: from its health while it runs, from run.json's outcome once the run ended."""
    ended = {} if live else (outcome.get("dropped") or {})
    for r in rows:
        kinds = r.get("bad_message_kinds") or ended.get(r["name"])
        if kinds:
            sources = r.get("bad_message_from") or (outcome.get("dropped_from") or {}).get(r["name"], ())
            print(f"warning: {describe_drops(r['name'], kinds, sources)}")


def _print_last_exits(rows: list[dict]) -> None:
    """Each worker's last exit after it was started (the launcher's words: signal or error line)."""
    for r in rows:
        if last := r.get("last_exit"):
            at = time.strftime("%H:%M:%S", time.localtime(last.get("at", 0)))
            print(f"{r['name']}: last exit at {at}, code {last['code']}: {last['cause']}")


def _read_plan(run_dir: Path) -> Plan | None:
    """The run's plan, as drafter rank 0 wrote it to schedule.json once it knew the data."""
    try:
        return Plan.from_dict(json.loads((run_dir / "schedule.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, int) and value > 1 << 20:
        return f"{value / (1 << 30):.2f}G"
    return str(value)
