"""`launcher report`: a PNG of loss and tau over steps, and a short summary, from <run_dir>/metrics.jsonl.

Real acceptance (greedy speculative decoding with the target, services/drafter/acceptance/speculative.py) is
plotted on the τ axes, in the same unit (tokens per verify step): the lines training wrote
(acceptance.jsonl) and the last `launcher eval` (spec_eval.jsonl). `launcher report --eval` runs
`launcher eval` on the run's latest checkpoint first.

No torch here. matplotlib is an optional extra (`pip install -e '.[report]'`); without it the
summary is printed and the message says how to get the plot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.decoding.acceptance_text import describe_prompts


class ReportError(Exception):
    pass


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) by step; a line cut by a crash is skipped, and so are real-acceptance
    lines (read_acceptance_lines reads them from acceptance.jsonl)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"no metrics in {run_dir} (missing {path}); is this a run dir?")
    train, evals = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if not record.get("spec"):
            (evals if record.get("eval") else train).append(record)
    return sorted(train, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["step"])


def read_acceptance_lines(run_dir: Path) -> tuple[list[dict], dict | None]:
    """(real-acceptance lines of training by step, the last `launcher eval` result or None)."""
    acceptance, last_eval = [], None
    for path in (run_dir / "acceptance.jsonl", run_dir / "spec_eval.jsonl"):
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("spec") and "step" in record:
                acceptance.append(record)
            elif record.get("event") == "spec_eval":
                last_eval = record
    return sorted(acceptance, key=lambda r: r["step"]), last_eval


def describe_real_acceptance(record: dict, what: str) -> list[str]:
    """Real acceptance in words: the drafter's and its controls' (when the record has them), per prompt set."""
    from services.decoding.acceptance_text import tables

    return tables(
        record,
        f"{what}; greedy speculative decoding of "
        f"{describe_prompts(record['prompts'], record.get('held_out'), record.get('sets') or ())}",
    )


def describe_cost(record: dict) -> str | None:
    """What real acceptance during training cost, as of a line of acceptance.jsonl (the final one: the
    whole run's training), or None when none ran (or the line is from before this was recorded)."""
    if not record.get("passes"):
        return None
    return (
        f"real acceptance during training: {record['passes']} passes, {record['spent_s']:.1f} s of "
        f"{record['wall_s']:.0f} s of training ({100 * record['cost_frac']:.1f}%)"
    )


def _pointer(run_dir: Path, name: str) -> str | None:
    link = run_dir / "checkpoints" / name
    return os.readlink(link) if link.is_symlink() else None


def describe_export(export: Path) -> str | None:
    """One line on an export: its step, last/best, and vLLM's num_speculative_tokens (block_size - 1)."""
    try:
        record = json.loads((export / "export.json").read_text())
    except (OSError, ValueError):
        return None
    which = " and ".join(w for w in ("last", "best") if record.get(w)) or "neither last nor best"
    best = "" if record.get("best") or record.get("best_step") is None else f", best is step {record['best_step']}"
    return (
        f"export: {export} (step {record['step']}: {which}{best}); "
        f"vLLM num_speculative_tokens = {record['num_speculative_tokens']} (block_size {record['block_size']} - 1)"
    )


def describe_data(info: dict) -> str:
    """The data line of `launcher up`, `status` and `report`, from <run_dir>/data.json."""
    skipped = (
        f"; skipped {info['bad_samples']} bad lines (data.on_bad_sample=skip), first: "
        + "; ".join(info["bad_examples"])
        if info["bad_samples"]
        else "; no bad lines"
    )
    line = f"data: {info['train_rows']} training rows, {info['eval_rows']} held-out rows{skipped}"
    if info.get("packing"):  # built now, or reused from this machine's store (no tokenizing)
        line += f"; {info['packing']}"
    if info.get("store_problem"):
        line += f"\nwarning: {info['store_problem']}"
    if info.get("prompts", info.get("chat_prompts")) == 0:  # ("chat_prompts": data.json of older runs)
        line += (
            "\nreal acceptance: off, the held-out data has no prompts (a pre-tokenized line's prompt is its "
            "tokens before the first supervised one: these have none); τ is still measured. For it, set "
            "eval.prompts to a prompt file (e.g. a benchmark's), or add chat lines or a data.eval_path"
        )
    return line


def throughput(train: list[dict], last: int) -> tuple[float, float, int, float] | None:
    """(tokens/s, data-wait share, records, seconds) over the last `last` train records: their tokens
    over their time, not the mean of their rates (that one gives a short fast window the weight of a
    long one); the data wait weighted by time the same way.
    Each record's window is window_tokens over window_s; in files written before those fields,
    the tokens since the previous record over them at the record's rate (tokens_per_s)."""
    tokens = seconds = waited = 0.0
    windows = 0
    for prev, r in list(zip([None] + train, train))[-last:]:
        if "window_tokens" in r and "window_s" in r:
            n, s = r["window_tokens"], r["window_s"]
        elif prev is not None and r.get("tokens_per_s") and "tokens_done" in r and "tokens_done" in prev:
            n = r["tokens_done"] - prev["tokens_done"]
            s = n / r["tokens_per_s"]
        else:
            continue
        tokens, seconds, windows = tokens + n, seconds + s, windows + 1
        waited += s * r.get("data_wait_frac", 0.0)
    return (tokens / seconds, waited / seconds, windows, seconds) if seconds > 0 else None


def summary(
    run_dir: Path, train: list[dict], evals: list[dict], acceptance: list[dict], last_eval: dict | None
) -> list[str]:
    lines = [f"run: {run_dir}"]
    if train:
        last = train[-1]
        rate = throughput(train, last=20)
        lines.append(
            f"steps: {last['step']} (train records: {len(train)}), samples {last.get('samples_done', '?')}, "
            f"tokens {last.get('tokens_done', '?')}"
        )
        coverage = f", coverage {100 * last['coverage']:.1f}%" if "coverage" in last else ""
        lines.append(
            f"final train loss {last['loss']:.4f}, tau {last['tau']:.3f}{coverage}, lr {last.get('lr', 0):.3g}"
        )
        if rate:
            tokens_per_s, wait, windows, seconds = rate
            lines.append(
                f"throughput: {tokens_per_s:,.0f} tokens/s (tokens ÷ time of the last {windows} records, "
                f"{seconds:,.0f} s), data wait {100 * wait:.0f}%"
            )
    else:
        lines.append("no train records yet")
    if evals:
        best = max(evals, key=lambda r: r["tau"])
        lines.append(
            f"eval: final loss {evals[-1]['loss']:.4f}, tau {evals[-1]['tau']:.3f}; "
            f"best tau {best['tau']:.3f} at step {best['step']}"
        )
    if (run_dir / "data.json").is_file():
        lines += describe_data(json.loads((run_dir / "data.json").read_text())).splitlines()
    if acceptance:
        last = acceptance[-1]
        lines += describe_real_acceptance(
            last, f"step {last['step']}{', end of training' if last.get('final') else ''}"
        )
        if cost := describe_cost(last):
            lines.append(cost)
    if last_eval:
        lines += describe_real_acceptance(last_eval, f"`launcher eval` of {last_eval.get('drafter', '?')}")
    if acceptance or last_eval:
        lines.append(
            "  (τ above is teacher-forced on the labels; real acceptance is what the target accepts: "
            "docs/guide/acceptance.md#tau-and-real-acceptance; every figure: docs/guide/monitoring.md#glossary)"
        )
    latest, best_ckpt = _pointer(run_dir, "latest"), _pointer(run_dir, "best")
    lines.append(f"checkpoints: latest {latest or '-'}, best {best_ckpt or '-'}")
    export = run_dir / "export"
    if (export / "config.json").is_file():
        lines.append(describe_export(export) or f"export: {export}")
    else:
        lines.append(f"export: none yet (launcher export --checkpoint {run_dir / 'checkpoints' / 'latest'} --out DIR)")
    return lines


def figure(train: list[dict], evals: list[dict], title: str, acceptance: list[dict] = ()):
    """The report's matplotlib figure: loss, and τ beside real acceptance, over steps. Each axes says
    what it shows in its title and its unit in a short y label (a long vertical label runs past the
    axes into the figure's title)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4.4))
    panels = (
        (ax_loss, "loss", "loss", "loss"),
        (ax_tau, "tau", "τ (teacher-forced) and real acceptance", "tokens per verify step"),
    )
    for ax, key, heading, unit in panels:
        if train:
            ax.plot([r["step"] for r in train], [r[key] for r in train], label="train", linewidth=1)
        if evals:
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", label="eval (held-out)")
        if key == "tau" and acceptance:  # the same unit: tokens committed per verify step
            ax.plot(
                [r["step"] for r in acceptance],
                [r["acceptance_per_step"] for r in acceptance],
                "s-",
                label="real acceptance (spec. decoding)",
            )
            final = acceptance[-1]
            for name, style in (("repeat_last", ":"), ("random", "--")):
                if name in final:
                    ax.axhline(
                        final[name]["acceptance_per_step"],
                        linestyle=style,
                        color="gray",
                        label=f"{name.replace('_', '-')} control",
                    )
        ax.set_title(heading, fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(train: list[dict], evals: list[dict], out: Path, title: str, acceptance: list[dict] = ()) -> None:
    import matplotlib.pyplot as plt

    fig = figure(train, evals, title, acceptance)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(run_dir: str | Path, out: str | Path | None = None) -> tuple[list[str], Path | None]:
    """Summary lines, and the PNG written (None when matplotlib is missing: the last line says so)."""
    run_dir = Path(run_dir).resolve()
    train, evals = read_metrics(run_dir)
    acceptance, last_eval = read_acceptance_lines(run_dir)
    lines = summary(run_dir, train, evals, acceptance, last_eval)
    png = Path(out) if out else run_dir / "report.png"
    try:
        plot(train, evals, png, title=run_dir.name, acceptance=acceptance)
    except ImportError:
        lines.append(
            "plot: matplotlib is not installed; pip install 'dflash-service[report]' "
            "(or pip install matplotlib) for the PNG"
        )
        return lines, None
    lines.append(f"plot: {png}")
    return lines, png
