"""`launcher regenerate`: one child per GPU (services/target/jobs/regenerate_shard.py, a shard of the lines
each), a live line while they work, the shards interleaved back into input order, and a summary
of what changed.

The data is read here first (no torch): a broken line, or data without a chat line (nothing to
regenerate), is one line and exit 2 before any model loads. --cut-prompts N: the shards continue N
prompts cut from the {"text"} lines (services/data/text_prompts.py), kept as OUT.prompts.jsonl.
The children's JSON progress lines feed one line: assistant turns done / total, turns per second,
ETA (from the first batch on, so the model load does not count). Their shards are hidden files
beside --out, removed at the end.
What was done (model, engine, chat-template options, sampling, the output's sha256) is written
beside --out (launcher/regen_record.py), for `up` to check the run renders the chats alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher.progress import ProgressLine, duration
from launcher.regen_record import write_record
from services.data.data_lines import plain_lines, read_conversations, replies_to_write, sample_path
from services.data.text_prompts import MIN_PROMPT_LINES, cut_prompts
from services.process import jobs
from services.run.config import toml_literal
from services.run.files import write_text_atomic


class RegenerateError(Exception):
    """Bad input or a failed child: one line for the user, exit 2."""


def _follow(child: subprocess.Popen, state: dict) -> None:
    """Read one child's stdout: progress and the final record into `state`; other text to stderr."""
    for line in child.stdout:
        try:
            record = json.loads(line)
            event = record.get("event")
        except (ValueError, AttributeError):
            event = None
        if event == "progress":
            state["done"], state["tokens"] = int(record["done"]), int(record.get("tokens", 0))
        elif event == "stage":
            state["stage"] = str(record.get("stage", ""))
        elif event == "regenerated":
            state["final"] = record
        else:
            sys.stderr.write(line)


def progress_text(done: int, total: int, rate: float, token_rate: float = 0.0) -> str:
    eta = duration((total - done) / rate) if rate > 0 else "?"
    pct = 100 * done / total if total else 100.0
    tokens = f", {token_rate:,.0f} generated tok/s" if token_rate > 0 else ""
    return f"regenerating: {done}/{total} replies ({pct:.1f}%), {rate:.1f} replies/s{tokens}, ETA {eta}"


def waiting_text(stage: str, seconds: float) -> str:
    """The progress line before the first token: what the shards are doing, and for how long."""
    return f"regenerating: {stage or 'starting'} ({seconds:.0f} s)"


def breakdown(finals: list[dict], total: int, tokens: int) -> str:
    """Where the time went, stage by stage (the slowest shard's), with the decoding rates."""
    names = {"start": "start", "read": "reading", "load": "model load", "tokenize": "tokenizing", "decode": "decoding"}
    stages = [f.get("stage_seconds") or {} for f in finals]
    took = {k: max(s.get(k, 0.0) for s in stages) for k in names if any(k in s for s in stages)}
    said = ", ".join(f"{names[k]} {v:.1f} s" for k, v in took.items())
    decode = took.get("decode", 0.0)
    if decode > 0:
        said += f" ({total / decode:.1f} replies/s, {tokens / decode:,.0f} generated tok/s while decoding)"
    return f"time: {said}"


def _kinds(chat: int, plain: int) -> str:
    """What the replies are: assistant turns of chat lines, continuations of plain-text lines."""
    said = [f"assistant turns of {chat} chat lines"] if chat else []
    return ", ".join(said + ([f"continuations of {plain} plain-text lines"] if plain else []))


def advice(out: Path, pre_tokenized: int) -> str:
    """How to train on the output. Data labels are the target's own replies only when every line
    was regenerated; copied pre-tokenized lines keep the data's tokens, so then the target labels."""
    if pre_tokenized:
        return (
            f'train on it with data.path="{out}" and target.labels_from_target=true (the default): its '
            f"{pre_tokenized} pre-tokenized lines keep the data's tokens, and only the target's labels "
            "match what it would write there"
        )
    return (
        f'train on it with data.path="{out}" and target.labels_from_target=false: every reply is now '
        "the target's own, so the data's labels are the target's"
    )


def template_advice(template_kwargs: dict) -> str:
    """The config line that makes training (and the eval) render the chats as they were regenerated."""
    literal = toml_literal(template_kwargs)
    return (
        f"train with data.chat_template_kwargs = {literal} (in [data]: chat_template_kwargs = {literal}), "
        "and serve with the same chat-template options: `launcher up` refuses other ones for this file"
    )


def interleave(shards: list[str]) -> list[str]:
    """One pass's lines in input order: shard i holds lines i, i+N, ... (N shards)."""
    rows = [text.splitlines() for text in shards]
    return [r[i] for i in range(max(map(len, rows), default=0)) for r in rows if i < len(r)]


def cut_text_prompts(data: Path, items: list, count: int, out: Path) -> tuple[Path, list]:
    """`count` prompts cut from the {"text"} lines of `data` (services/data/text_prompts.py) into a file
    beside `out`, and its items; RegenerateError when there is no text line to cut."""
    if count < 0:
        raise RegenerateError(f"--cut-prompts {count}: a count of prompts, 0 (none: the lines themselves) or more")
    texts = [r["text"] for r, m in items if m is None and isinstance(r, dict) and isinstance(r.get("text"), str)]
    prompts = cut_prompts(texts, count)
    if not prompts:
        raise RegenerateError(
            f'--cut-prompts {count}: {data} has no {{"text"}} line of {MIN_PROMPT_LINES} lines or more to cut '
            "prompts from"
        )
    path = out.with_name(f"{out.name}.prompts.jsonl")
    write_text_atomic(path, "".join(json.dumps(p) + "\n" for p in prompts))
    return path, [(p, None) for p in prompts]  # what read_conversations gives for them: plain lines


def run(args) -> None:
    """Regenerate args.data into args.out, then print what changed. Raises RegenerateError."""
    data, out = Path(args.data), Path(args.out).resolve()
    try:
        items = read_conversations(data)
    except ValueError as exc:  # names file:line
        raise RegenerateError(str(exc)) from None
    source, cut = data, args.cut_prompts
    if cut:  # the shards continue prompts cut from the text lines, written beside --out
        data, items = cut_text_prompts(data, items, cut, out)
    chat = sum(m is not None for _, m in items)
    plain = plain_lines(items)
    if not chat + plain:
        raise RegenerateError(
            f"{data} has no chat or plain-text lines ({len(items)} pre-tokenized lines): regeneration "
            f"rewrites assistant turns of chat text and continues plain-text prompts; train on {data} "
            "as it is (target.labels_from_target=true, the default, has the target label it)"
        )
    if args.samples < 0 or (args.samples and args.sample_temperature <= 0):
        raise RegenerateError(
            f"--samples {args.samples} --sample-temperature {args.sample_temperature}: sampled passes need "
            "--samples >= 1 and --sample-temperature > 0 (--temperature sets the first pass)"
        )
    total = replies_to_write(items) * (1 + args.samples)
    gpus = [str(g) for g in args.gpu_list] if args.device == "cuda" else [None]
    base = [
        *jobs.argv("regenerate-shard"),
        "--model",
        args.model,
        "--data",
        str(data),
        "--engine",
        args.engine,
        "--device",
        args.device,
        "--batch-size",
        str(args.batch_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(args.temperature),
        "--samples",
        str(args.samples),
        "--sample-temperature",
        str(args.sample_temperature),
        "--chat-template-kwargs",
        json.dumps(args.template_kwargs),
    ]
    parts = [out.with_name(f".{out.name}.part{i}") for i in range(len(gpus))]
    passes = [parts] + [[sample_path(part, k) for part in parts] for k in range(1, args.samples + 1)]
    where = f"{len(gpus)} GPUs" if len(gpus) > 1 else (f"GPU {gpus[0]}" if gpus[0] is not None else "the CPU")
    line = ProgressLine()
    options = f", chat template with {json.dumps(args.template_kwargs)}" if args.template_kwargs else ""
    sampled = f", then {args.samples} sampled at temperature {args.sample_temperature}" if args.samples else ""
    line.done(
        f"regenerating {total} replies ({_kinds(chat, plain)}{sampled}) of {data} on {where}{options} "
        f"({len(items) - chat - plain} pre-tokenized lines are copied unchanged)"
    )
    start, children, states, readers = time.monotonic(), [], [], []
    try:
        for i, (gpu, part) in enumerate(zip(gpus, parts)):
            env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
            child = subprocess.Popen(
                base + ["--out", str(part), "--shard", f"{i}/{len(gpus)}"], env=env, stdout=subprocess.PIPE, text=True
            )
            children.append(child)
            states.append({"done": 0, "tokens": 0, "final": None, "stage": ""})
            readers.append(threading.Thread(target=_follow, args=(child, states[-1]), daemon=True))
            readers[-1].start()
        first: tuple[float, int] | None = None  # (time, turns) at the first batch done
        decoding: tuple[float, int] | None = None  # (time, tokens) at the first token generated
        while any(c.poll() is None for c in children):
            now, done, tokens = time.monotonic(), sum(s["done"] for s in states), sum(s["tokens"] for s in states)
            if done and first is None:
                first = (now, done)
            if tokens and decoding is None:
                decoding = (now, tokens)
            rate = (done - first[1]) / (now - first[0]) if first and now > first[0] else 0.0
            token_rate = (tokens - decoding[1]) / (now - decoding[0]) if decoding and now > decoding[0] else 0.0
            if decoding or done:
                line.show(progress_text(done, total, rate, token_rate))
            else:  # loading: say what, not "0 replies"
                line.show(waiting_text(states[0]["stage"], now - start))
            time.sleep(0.5)
        for reader in readers:
            reader.join(timeout=10)
        codes = [c.wait() for c in children]
        if any(codes) or any(s["final"] is None for s in states):
            raise RegenerateError(
                f"regeneration failed (exit codes {codes}; the error is above); {out.name} was not written"
            )
        tmp = out.with_name(f".{out.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for shard_files in passes:  # the first pass, then each sampled one: each in input order
                f.writelines(row + "\n" for row in interleave([p.read_text(encoding="utf-8") for p in shard_files]))
        os.replace(tmp, out)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for part in (p for shard_files in passes for p in shard_files):
            part.unlink(missing_ok=True)
    finals = [s["final"] for s in states]
    empty, pre_tokenized = sum(f["empty_replies_kept"] for f in finals), sum(f["pre_tokenized"] for f in finals)
    record = write_record(
        out,
        {
            "model": str(Path(args.model).resolve()),
            "engine": args.engine,
            "chat_template_kwargs": args.template_kwargs,
            "temperature": args.temperature,
            "samples": args.samples,
            "sample_temperature": args.sample_temperature if args.samples else None,
            "max_new_tokens": args.max_new_tokens,
            "data": str(source.resolve()),
            "cut_prompts": cut,
            "lines": len(items),
            "chat_lines": chat,
            "plain_lines": plain,
            "turns": total,
            "empty_replies_kept": empty,
        },
    )
    lines = [
        f"regenerated {sum(f['turns'] for f in finals) - empty} replies ({_kinds(chat, plain)}) "
        f"in {duration(time.monotonic() - start)} ({args.engine}, {where})"
    ]
    lines.append(breakdown(finals, sum(f["turns"] for f in finals), sum(s["tokens"] for s in states)))
    if empty:
        lines.append(f"{empty} replies came back empty: those turns keep the data's text")
    if pre_tokenized:
        lines.append(f"{pre_tokenized} pre-tokenized lines copied unchanged (no text to regenerate)")
    written = sum(f["lines"] for f in finals) + args.samples * (chat + plain)
    order = f"in input order, then {args.samples} sampled passes of its {chat + plain} lines" if args.samples else ""
    lines += [
        f"wrote {out}: {written} lines, {order or 'in input order'} "
        f"(how it was made: {record.name}, read by `launcher up`)",
        advice(out, pre_tokenized),
    ]
    if args.template_kwargs:
        lines.append(template_advice(args.template_kwargs))
    for text in lines:
        line.done(text)
