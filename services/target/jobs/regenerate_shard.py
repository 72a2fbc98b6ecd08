"""Regenerate the assistant turns of a chat JSONL with the target: the data the target would write.

A DFlash drafter is trained to predict the target. Its labels are the data's tokens by default;
when the target would not have written those replies, the drafter learns text the target never
produces. Three ways to line the labels up with the target (docs/guide/data.md#which-labels):
  - data labels (target.labels_from_target=false): right when the data *is* the target's output;
  - target labels (target.labels_from_target=true): the target's teacher-forced argmax on the data,
    computed during capture; no extra pass, but the context is still the data's text;
  - this step: every assistant turn rewritten by the target (greedy by default), turn by turn, each
    turn seeing the earlier turns as the target wrote them; then train with data labels. Context
    and labels are then exactly what the target produces in real decoding.

    python -m services.target.jobs.regenerate_shard --model PATH --data IN.jsonl --out OUT.jsonl
        [--batch-size 0] [--max-new-tokens 1024] [--engine hf|vllm|sglang] [--device cuda|cpu]
        [--shard I/N] [--chat-template-kwargs '{"enable_thinking": false}']
        [--samples K --sample-temperature T]

Every engine renders the prompts with --chat-template-kwargs (the chat template's extra variables,
as data.chat_template_kwargs gives them to training): the replies are what the target writes
under the options it will be served with.

Engines: "hf" (default) decodes many prompts at once on one KV cache, a row per prompt
(services/target/verify/slots.py: one forward per token for the whole batch, greedy output identical to
transformers' `generate`; temperature > 0 samples over the whole vocabulary), for any target of
attention and Gated DeltaNet layers (the hybrids' recurrent state kept per row); any other runs
transformers' batched `generate` (left padding). vLLM or SGLang when installed (their own batching).
`launcher regenerate --gpus 0-3` runs one shard per GPU (lines
i, i+N, ...) and interleaves the shards back into the input order. Lines that are not chat
(pre-tokenized) are copied unchanged. Output lines are OpenAI-style {"messages": [...]}.
--samples K: after that pass, K more of the lines with text to regenerate, each reply sampled at
--sample-temperature (pass k of shard i from seed SAMPLE_SEED * k + i), to OUT.sample1..K: more
varied replies per prompt for the drafter to learn from (docs/guide/data.md).

Stdout is JSON lines: {"event": "stage", "stage": WHAT} as the shard starts reading, loading and
decoding, {"event": "progress", "done": D, "total": T, "tokens": N} (assistant turns done, tokens
generated) after each batch and every 2 s inside one, and one {"event": "regenerated", ...} at the
end with what changed (lines, chat lines, plain-text lines, pre_tokenized lines copied unchanged,
turns rewritten, empty_replies_kept) and stage_seconds: the seconds of each stage (start: the
interpreter and torch; read; load; tokenize; decode). `launcher regenerate`
reads them for its progress line and summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import psutil

from services.data.data_lines import (
    plain_lines,
    plain_prompt,
    read_conversations,
    regenerable,
    replies_to_write,
    sample_path,
)
from services.run.files import write_text_atomic


class HFEngine:
    """Batched greedy (or sampled) decoding, prompts sorted by length: rows of a KV cache (verify/slots.py)
    for an attention-only target, else HF generate, left-padded."""

    def __init__(self, model_path: str, device: str, temperature: float, template_kwargs: dict | None = None):
        import torch
        from transformers import AutoTokenizer

        from services.target.model.model import load_causal_lm

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.model = load_causal_lm(model_path, dtype, device)  # the training target's loader, HF's attention
        self.slots = slot_target(self.model)  # None: a recurrent target, HF generate
        self.device, self.template_kwargs = device, template_kwargs or {}
        self.tokenize_s = 0.0  # of the prompts, for the summary's breakdown
        self.set_sampling(temperature, seed=0)
        self.pad = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )

    def set_sampling(self, temperature: float, seed: int) -> None:
        """Greedy (0) or sampled at `temperature`, from a generator seeded with `seed` (the slot rows'
        own; transformers' generate draws from torch's global one, seeded here too)."""
        self.temperature = temperature
        self.generator = self.torch.Generator(self.device).manual_seed(seed) if temperature > 0 else None
        self.torch.manual_seed(seed)

    def generate(self, conversations: list[list[dict]], max_new_tokens: int, batch_size: int, tick=None) -> list[str]:
        from services.data.data_lines import many_prompt_tokens

        torch = self.torch
        began = time.perf_counter()
        prompts = many_prompt_tokens(self.tokenizer, conversations, self.template_kwargs)
        self.tokenize_s += time.perf_counter() - began
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        replies = [""] * len(prompts)
        sampling = (
            {"do_sample": True, "temperature": self.temperature}
            if self.temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        )
        if batch_size <= 0:  # auto: as many as fit
            batch_size = self.rows_that_fit(max(map(len, prompts), default=1) + max_new_tokens + 1)
        # KV-cache rows: batch_size rows, each taking the next prompt when its reply ends (continuous
        # batching), over windows of WINDOW_BATCHES batches (what the device keeps of every prompt)
        step = batch_size * WINDOW_BATCHES if self.slots is not None else batch_size
        for start in range(0, len(order), step):
            chunk = order[start : start + step]
            if self.slots is not None:
                from services.target.verify.slots import decode_slots

                outs = decode_slots(
                    self.slots,
                    None,
                    [prompts[i] for i in chunk],
                    max_new_tokens=max_new_tokens,
                    stop_ids=[self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [],
                    temperature=self.temperature,
                    generator=self.generator,
                    on_step=(lambda tokens: tick(0, tokens)) if tick else None,
                    on_done=tick,
                    rows=batch_size,
                )
                for i, out in zip(chunk, outs):
                    replies[i] = self.reply(conversations[i], out.tokens)
                continue
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            with torch.no_grad():
                out = self.model.generate(
                    ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=max_new_tokens,
                    pad_token_id=self.pad,
                    eos_token_id=self.tokenizer.eos_token_id,
                    **sampling,
                )
            for row, i in enumerate(chunk):
                replies[i] = self.reply(conversations[i], out[row, width:])
            if tick:
                tick(len(chunk))
        return replies

    def reply(self, prompt, tokens) -> str:
        """The new tokens as text: a chat reply stripped, a continuation of plain text as it is (its
        leading space belongs to it). The end-of-text token that stopped it is not text, special or not."""
        tokens = list(tokens)
        if tokens and tokens[-1] == self.tokenizer.eos_token_id:
            tokens.pop()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text.strip() if isinstance(prompt, list) else text

    def rows_that_fit(self, capacity: int) -> int:
        """Prompts at once when --batch-size is 0: on a GPU, as many KV-cache rows of `capacity` tokens
        as half the free memory holds, at most AUTO_ROWS (slot_cache.rows_that_fit); AUTO_ROWS_CPU on CPU
        and for HF generate."""
        if self.device == "cpu" or self.slots is None:
            return AUTO_ROWS_CPU
        from services.target.verify.slot_cache import rows_that_fit

        return rows_that_fit(self.model, self.device, capacity, AUTO_ROWS)


# --batch-size 0 (auto) at most: 3 072 rows were 1.1x the replies/s of 1 536 on a 135M target, an H200
# (docs/benchmarks.md, "Evaluation and regeneration speed"); on CPU, rows bound by the cores
AUTO_ROWS, AUTO_ROWS_CPU = 3072, 32
WINDOW_BATCHES = 16  # prompts one decode_slots call takes, in batches: its record of them all lies on the GPU


def slot_target(model):
    """The model as a Target decoded on rows of a KV cache (verify/slots.py), or None when it has a layer
    slot decoding does not run (a recurrent layer other than the Gated DeltaNet, or one without
    flash-linear-attention's kernels on CUDA: the Target then runs one document at a time)."""
    from services.target.model.attention import PACKED_SDPA, register_packed_sdpa
    from services.target.model.model import Target
    from services.target.verify.slots import slot_decodable

    register_packed_sdpa()
    model.config._attn_implementation = PACKED_SDPA  # its slot branch reads the rows' masks
    target = Target(model, [])
    return target if slot_decodable(target) else None


class VLLMEngine:
    """vLLM's offline LLM.chat (not exercised by the tests: vLLM needs a GPU)."""

    def __init__(self, model_path: str, device: str, temperature: float, template_kwargs: dict | None = None):
        from vllm import LLM

        self.llm, self.template_kwargs = LLM(model=model_path), template_kwargs or {}
        self.set_sampling(temperature, seed=0)

    def set_sampling(self, temperature: float, seed: int) -> None:
        self.temperature, self.seed = temperature, seed

    def generate(self, conversations, max_new_tokens, batch_size, tick=None):
        from vllm import SamplingParams

        params = SamplingParams(temperature=self.temperature, max_tokens=max_new_tokens, seed=self.seed)
        if all(isinstance(c, str) for c in conversations):  # plain text: a base model continues it
            replies = [o.outputs[0].text for o in self.llm.generate(conversations, params, use_tqdm=False)]
        else:
            outputs = self.llm.chat(conversations, params, use_tqdm=False, chat_template_kwargs=self.template_kwargs)
            replies = [o.outputs[0].text.strip() for o in outputs]
        if tick:
            tick(len(replies))
        return replies


class SGLangEngine:
    """SGLang's offline Engine (not exercised by the tests: SGLang needs a GPU)."""

    def __init__(self, model_path: str, device: str, temperature: float, template_kwargs: dict | None = None):
        import sglang
        from transformers import AutoTokenizer

        self.engine, self.temperature = sglang.Engine(model_path=model_path), temperature
        self.template_kwargs = template_kwargs or {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def set_sampling(self, temperature: float, seed: int) -> None:
        self.temperature = temperature  # SGLang's own sampling state: passes differ, not reproducibly

    def generate(self, conversations, max_new_tokens, batch_size, tick=None):
        prompts = [
            self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **self.template_kwargs)
            if isinstance(m, list)
            else m  # plain text: a base model continues it
            for m in conversations
        ]
        out = self.engine.generate(prompts, {"temperature": self.temperature, "max_new_tokens": max_new_tokens})
        if tick:
            tick(len(out))
        return [o["text"].strip() if isinstance(m, list) else o["text"] for m, o in zip(conversations, out)]


ENGINES = {"hf": HFEngine, "vllm": VLLMEngine, "sglang": SGLangEngine}
SAMPLE_SEED = 1_000_003  # sampled pass k of shard i draws from seed SAMPLE_SEED * k + i


def write_lines(path: Path, records: list[dict]) -> Path:
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def regenerate(
    engine,
    items: list[tuple[dict, list | None]],
    max_new_tokens: int,
    batch_size: int,
    counts: dict | None = None,
    tick=None,
) -> list[dict]:
    """Rewrite every assistant turn, round by round: round r regenerates each conversation's r-th
    assistant turn, seeing the turns before it as already rewritten. A plain-text line ({"prompt"}
    or {"text"}: a base model's data) becomes {"prompt": its text, "completion": the target's
    continuation}. An empty reply (the target
    ends the turn at once) keeps the data's reply: a turn without text has nothing to train; an empty
    continuation keeps the line's text, a {"prompt"} line's as {"text"} (a prompt without a completion
    would not train); counts["empty"] says how many. tick(n): n more turns done."""
    counts = counts if counts is not None else {}
    counts.setdefault("empty", 0)
    convs = [list(m) if m is not None else None for _, m in items]
    rounds = max((sum(m["role"] == "assistant" for m in c) for c in convs if c), default=0)
    for r in range(rounds):
        where = []  # (conversation, message index) of each r-th assistant turn
        for ci, c in enumerate(convs):
            turns = [i for i, m in enumerate(c or []) if m["role"] == "assistant"]
            if len(turns) > r:
                where.append((ci, turns[r]))
        replies = engine.generate([convs[ci][:mi] for ci, mi in where], max_new_tokens, batch_size, tick=tick)
        for (ci, mi), reply in zip(where, replies):
            if reply:
                convs[ci][mi] = {"role": "assistant", "content": reply}
            else:
                counts["empty"] += 1
    out = [{"messages": c} if c is not None else record for (record, _), c in zip(items, convs)]
    texts = [plain_prompt(record) if m is None else None for record, m in items]
    plain = [(i, text) for i, text in enumerate(texts) if text is not None]
    completions = engine.generate([text for _, text in plain], max_new_tokens, batch_size, tick=tick) if plain else []
    for (i, text), completion in zip(plain, completions):
        rest = {k: v for k, v in items[i][0].items() if k not in ("text", "prompt", "completion")}
        if completion.strip():  # a base model's line: the prompt, and the target's continuation of it
            out[i] = {**rest, "prompt": text, "completion": completion}
        else:
            out[i] = {**rest, "text": text}
            counts["empty"] += 1
    return out


def main(argv=None) -> int:
    from services.process import torchao_gate

    torchao_gate.hide()  # transformers would import it (and print its warnings) for nothing here
    p = argparse.ArgumentParser(
        prog="python -m services.target.jobs.regenerate_shard", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="the target (local HF folder)")
    p.add_argument("--data", required=True, help="chat JSONL to regenerate")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    p.add_argument("--device", default="")
    p.add_argument("--batch-size", type=int, default=0, help="0: as many as fit (HFEngine.rows_that_fit)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (what greedy decoding will see)")
    p.add_argument("--samples", type=int, default=0, help="sampled passes after the first, each to OUT.sample<k>")
    p.add_argument("--sample-temperature", type=float, default=1.0, help="the sampled passes' temperature")
    p.add_argument("--shard", default="0/1", help="I/N: this process regenerates lines I, I+N, ...")
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default={},
        help="JSON object of chat-template variables, e.g. '{\"enable_thinking\": false}'",
    )
    args = p.parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars in the launcher's output
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shard, num_shards = (int(x) for x in args.shard.split("/"))
    start = time.perf_counter()
    seconds_at = start - (time.time() - psutil.Process().create_time())  # the stage "start" from the exec
    seconds: dict[str, float] = {}  # what each stage took, for the launcher's summary

    def stage(done: str, next_stage: str) -> None:
        """`done` took the time since the last stage; the launcher shows `next_stage` until decoding."""
        nonlocal seconds_at
        seconds[done], seconds_at = round(time.perf_counter() - seconds_at, 2), time.perf_counter()
        print(json.dumps({"event": "stage", "stage": next_stage}), flush=True)

    stage("start", "reading the data")
    try:
        items = read_conversations(args.data, shard, num_shards)
    except ValueError as exc:  # a broken line: one line naming it, exit 2
        print(f"regenerate: error: {exc}", file=sys.stderr, flush=True)
        return 2
    stage("read", "loading the model")
    engine = ENGINES[args.engine](args.model, device, args.temperature, args.chat_template_kwargs)
    stage("load", "tokenizing the prompts, then decoding")
    counts, done, total = {}, 0, replies_to_write(items) * (1 + args.samples)

    generated, said = 0, time.monotonic()

    def tick(n: int, tokens: int = 0) -> None:
        """n more turns done, `tokens` more generated: a progress line per batch, and every 2 s
        inside one (a batch of long replies runs for minutes)."""
        nonlocal done, generated, said
        done, generated = done + n, generated + tokens
        if n or time.monotonic() - said >= 2:
            said = time.monotonic()
            print(json.dumps({"event": "progress", "done": done, "total": total, "tokens": generated}), flush=True)

    records = regenerate(engine, items, args.max_new_tokens, args.batch_size, counts, tick=tick)
    out = write_lines(Path(args.out), records)
    rewritten = regenerable(items)
    for k in range(1, args.samples + 1):  # each pass its own seed, distinct across passes and shards
        engine.set_sampling(args.sample_temperature, seed=SAMPLE_SEED * k + shard)
        sampled = regenerate(engine, rewritten, args.max_new_tokens, args.batch_size, counts, tick)
        write_lines(sample_path(out, k), sampled)
    seconds["decode"] = round(time.perf_counter() - seconds_at, 2)
    if getattr(engine, "tokenize_s", 0):  # the engine tokenized inside the decode stage
        seconds["tokenize"] = round(engine.tokenize_s, 2)
        seconds["decode"] = round(seconds["decode"] - engine.tokenize_s, 2)
    chat = sum(m is not None for _, m in items)
    plain = plain_lines(items)
    print(
        json.dumps(
            {
                "event": "regenerated",
                "out": str(out),
                "lines": len(records),
                "chat": chat,
                "plain": plain,
                "pre_tokenized": len(records) - chat - plain,
                "samples": args.samples,
                "turns": total,
                "empty_replies_kept": counts["empty"],
                "engine": args.engine,
                "device": device,
                "chat_template_kwargs": args.chat_template_kwargs,
                "seconds": round(time.perf_counter() - start, 2),
                "stage_seconds": seconds,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
