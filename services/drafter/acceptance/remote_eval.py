"""Real acceptance during training, verified by the target workers (docs/guide/acceptance.md, "Real
acceptance during training"): drafter rank 0 proposes, the targets verify; no drafter loads the target.

    settings = RemoteEvalSettings.from_config(cfg, at)  # at: a Placement (services/run/placement.py)
    spec_eval = RemoteSpecEval(settings, head, model_cfg, health, prompts=16, max_new_tokens=128)
    result = spec.evaluate(weights, model_cfg, controls=False, budget_s=60)

Prompt i (and its plain greedy reference) goes to target i mod T, so the eval's load is spread
over the targets and a prompt and its reference meet the same process. The drafter proposes with
the target's embedding and lm_head it already trains with (TargetHead on its device).

Failures never stop the run or hang it: every call has a timeout (verify.CALL_TIMEOUT_S); a prompt
whose session is lost (its target restarted, or evicted it) is decoded once more from the start on
the target's current incarnation, then skipped and counted (`skipped`); a target that did not
answer in time, or is not serving, is left out for the rest of that evaluation.
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.data.prompts import interleave, prompt_sets, stop_token_ids
from services.decoding.decode_progress import Progress
from services.decoding.decode_step import Decoded, Step
from services.drafter.acceptance.spec_eval import SpecEval
from services.drafter.acceptance.speculative import greedy_reference, speculative_generate, summarize_sets
from services.net.endpoints import endpoint
from services.net.health_probe import Drops
from services.net.verify import SessionLost, TargetUnavailable, VerifyError
from services.net.verify_client import VerifyClient
from services.run.config import Config, DataConfig, TransportConfig
from services.run.placement import Placement
from services.run.runspec import HeldOut

log = logging.getLogger("drafter")


class RemoteVerifier:
    """The Verifier of speculative.py over one session on a target worker. verify() is the whole
    step there (the target commits the accepted prefix + 1 itself), so commit(n) only checks that
    the loop kept the same tokens."""

    def __init__(self, client: VerifyClient, target: int, session: int, device, features: bool = True):
        self.client, self.target, self.session, self.device, self.features = client, target, session, device, features
        self.committed = 0
        self.opened = False

    def _step(self, reply) -> Step:
        features = reply.features.to(self.device) if reply.features is not None else None
        return Step(torch.tensor(reply.greedy), torch.tensor(reply.margin), torch.tensor(reply.tolerance), features)

    def prefill(self, prompt_ids: list[int]) -> Step:
        self.opened = True
        return self._step(self.client.open(self.target, self.session, prompt_ids, self.features))

    def verify(self, block_ids: list[int]) -> Step:
        reply = self.client.step(self.target, self.session, block_ids, self.features)
        self.committed = reply.committed
        return self._step(reply)

    def commit(self, n: int) -> None:
        if n != self.committed:
            raise VerifyError(f"the target committed {self.committed} tokens of the block, the loop {n}")

    def close(self) -> None:
        if self.opened:
            self.client.close_session(self.target, self.session)


ROWS_TOKENS = 1 << 16  # prompt tokens of one open-rows request (8 bytes each: under transport.MAX_REQUEST_BYTES)


@torch.no_grad()
def decode_rows(
    client, target: int, session: int, prompts, propose, *, max_new_tokens, stop_ids, device, tick=None, end_early=None
):
    """speculative_generate (propose None: greedy_reference) for all `prompts` at once on one session of
    rows on `target`: a round trip a step for all of them, each step one target forward. The target
    commits each row's accepted drafts + 1 itself; the same rule here (Decoded.accept) must agree.
    tick(new tokens) after each step; end_early() true after a step ends every row where it is."""
    stop, began, features = set(stop_ids), time.perf_counter(), propose is not None
    reply = client.open_rows(target, session, prompts, features)
    outs, contexts, at = [], [], 0
    for k, n in enumerate(reply.counts):
        outs.append(Decoded([reply.greedy[k]], [], 1, [reply.margin[k]], [reply.tolerance[k]]))
        contexts.append(reply.features[at : at + n].to(device) if features else None)
        at += n
    active = [k for k, out in enumerate(outs) if not out.done(max_new_tokens, stop)]
    while active:
        lasts = [outs[k].tokens[-1] for k in active]
        drafts = propose.many([contexts[k] for k in active], lasts) if features else [[] for _ in active]
        reply = client.step_rows(target, session, active, [[t] + d for t, d in zip(lasts, drafts)], features)
        q, at, still, new = len(drafts[0]) + 1, 0, [], 0
        for j, (k, d) in enumerate(zip(active, drafts)):
            cut, had = slice(j * q, (j + 1) * q), len(outs[k].tokens)
            said = reply.greedy[cut], reply.margin[cut], reply.tolerance[cut]
            accepted = outs[k].accept(d, *said, max_new_tokens, stop)
            n, new = reply.counts[j], new + len(outs[k].tokens) - had
            if n != accepted + 1:
                raise VerifyError(f"target {target} committed {n} tokens of row {k}'s block, the loop {accepted + 1}")
            if features:
                contexts[k] = torch.cat([contexts[k], reply.features[at : at + n].to(device)])
            at += n
            if not outs[k].done(max_new_tokens, stop):
                still.append(k)
        active = still
        if tick:
            tick(new)
        if end_early and end_early():
            break
    seconds = (time.perf_counter() - began) / len(prompts)  # the batch's wall time, shared out
    for out in outs:
        out.seconds = seconds
    return outs


def batches(indices: list[int], lengths: list[int], most: int) -> list[list[int]]:
    """`indices` in order, cut into batches of at most `most` prompts and ROWS_TOKENS prompt tokens."""
    out, tokens = [], 0
    for i, n in zip(indices, lengths):
        if not out or len(out[-1]) >= most or tokens + n > ROWS_TOKENS:
            out.append([])
            tokens = 0
        out[-1].append(i)
        tokens += n
    return out


def models_in_process() -> int:
    """HF models alive in this process (the eval must not need one: the targets verify). No model can
    exist before transformers.modeling_utils is imported, and importing it here would register ~50
    ModelOutput classes with torch's pytree, which fails a guard of every graph the drafter compiled
    (on CUDA it recompiled flex attention after the first two evaluations)."""
    if "transformers.modeling_utils" not in sys.modules:
        return 0
    from transformers import PreTrainedModel

    def is_model(o) -> bool:
        try:
            return isinstance(o, PreTrainedModel)
        except ReferenceError:  # a weakref.proxy whose object is gone (torch.compile leaves some): not a model
            return False

    return sum(map(is_model, gc.get_objects()))


@dataclass(frozen=True)
class RemoteEvalSettings:
    """What the real-acceptance eval reads of the run, from the config once: where the targets listen, the
    target's tokenizer, and where its prompts come from."""

    at: Placement  # the run folder and the targets to ask
    transport: TransportConfig
    model_path: str  # target.model_path: its tokenizer and generation config
    data: DataConfig  # pack_len (the longest prompt a target takes), chat_template_kwargs
    held_out: HeldOut
    files: list[str]  # eval.prompts; [] = the held-out lines
    max_rows: int  # eval.num_prompts: the rows a target takes in one (its VerifyLimits)

    @classmethod
    def from_config(cls, cfg: Config, at: Placement) -> "RemoteEvalSettings":
        return cls(
            at=at,
            transport=cfg.transport,
            model_path=cfg.target.model_path,
            data=cfg.data,
            held_out=HeldOut.of(cfg),
            files=list(cfg.eval.prompts),
            max_rows=max(1, cfg.eval.num_prompts),
        )


class RemoteSpecEval(SpecEval):
    def __init__(self, settings: RemoteEvalSettings, head, model_cfg, health, *, prompts: int, max_new_tokens: int):
        from transformers import AutoTokenizer, GenerationConfig

        s, t = settings, settings.transport
        self.device, self.head_on_device = head.embed.device, head
        self.dtype = head.embed.dtype
        self.client = VerifyClient(
            [endpoint(s.at.run_dir, t, "target", i, "data") for i in range(s.at.num_targets)],
            [endpoint(s.at.run_dir, t, "target", i, "health") for i in range(s.at.num_targets)],
            t,
            width=model_cfg.hidden_width,
            drops=Drops(health),
        )
        self.tokenizer = AutoTokenizer.from_pretrained(s.model_path)
        try:
            generation = GenerationConfig.from_pretrained(s.model_path)
        except (OSError, ValueError):
            generation = None
        self.stop_ids = stop_token_ids(self.tokenizer, SimpleNamespace(generation_config=generation))
        self.max_new_tokens = max_new_tokens
        every, names = interleave(prompt_sets(s.held_out, s.data, self.tokenizer, s.files, prompts))
        fits = [i for i, p in enumerate(every) if len(p) <= s.data.pack_len]  # what a target accepts
        self.prompts, self.names = [every[i] for i in fits], [names[i] for i in fits]
        # where the prompts come from: eval.prompts' files (None), held-out lines (True) or training lines
        self.held_out = None if s.files else s.held_out.exists
        if len(self.prompts) < len(every):
            log.warning(
                "real acceptance: %d prompts longer than data.pack_len=%d are left out",
                len(every) - len(self.prompts),
                s.data.pack_len,
            )
        self._refs: dict[int, object] = {}
        self._controls: dict[tuple, dict] = {}
        self.progress = Progress("real acceptance", say=log.info)
        self._sessions = itertools.count(1)
        self.down: set[int] = set()
        self.skipped = 0
        self.rows = True  # verify on sessions of rows (decode_rows) until a target refuses them
        self.max_rows = s.max_rows  # what a target takes in one (its VerifyLimits)

    def head(self, model_cfg):
        return self.head_on_device

    def close(self) -> None:
        self.client.close()

    def _attempt(self, index: int, decode, features: bool):
        """decode(verifier) for prompt `index` on its target: once more after a lost session; None if given up."""
        target = index % self.client.num_targets
        for attempt in range(2):
            if target in self.down:
                break
            verifier = RemoteVerifier(self.client, target, next(self._sessions), self.device, features)
            try:
                return decode(verifier)
            except TargetUnavailable as exc:
                log.warning(
                    "real acceptance: prompt %d: %s; target %d is left out of this evaluation", index, exc, target
                )
                self.down.add(target)
            except VerifyError as exc:
                log.warning("real acceptance: prompt %d, attempt %d: %s", index, attempt + 1, exc)
            finally:
                verifier.close()
        self.skipped += 1
        return None

    def _reference(self, index: int):
        if index not in self._refs:
            ref = self._attempt(
                index,
                lambda v: greedy_reference(v, self.prompts[index], self.max_new_tokens, self.stop_ids),
                features=False,
            )
            if ref is None:
                return None
            self._refs[index] = ref
        return self._refs[index]

    def _rows(self, indices: list[int], propose, tick, past_budget, end_early=None) -> dict[int, Decoded]:
        """Prompts `indices` decoded on sessions of rows, each target its own prompts (index mod T),
        in batches (batches()) until past_budget(); what was decoded, by index (end_early: decode_rows').
        A batch whose session is lost is decoded once more, then skipped; a target that refuses rows (it
        cannot run them) turns this process to prompt-by-prompt sessions (self.rows False)."""
        done: dict[int, Decoded] = {}

        def stepped(tokens: int) -> None:
            self.progress.add(tokens)  # a log line every 10 s while it lasts
            if tick:
                tick()

        for target in range(self.client.num_targets):
            mine = [i for i in indices if i % self.client.num_targets == target]
            for batch in batches(mine, [len(self.prompts[i]) for i in mine], self.max_rows):
                for attempt in range(2):
                    if target in self.down or not self.rows or (done and past_budget()):
                        break
                    session = next(self._sessions)
                    try:
                        prompts = [self.prompts[i] for i in batch]
                        limits = dict(max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, device=self.device)
                        outs = decode_rows(
                            self.client, target, session, prompts, propose, **limits, tick=stepped, end_early=end_early
                        )
                        done.update(zip(batch, outs))
                        break
                    except TargetUnavailable as exc:
                        log.warning("real acceptance: %s; target %d is left out of this evaluation", exc, target)
                        self.down.add(target)
                    except SessionLost as exc:
                        log.warning("real acceptance: %d prompts, attempt %d: %s", len(batch), attempt + 1, exc)
                    except VerifyError as exc:  # refused: this target cannot verify on rows
                        log.warning("real acceptance: %s; verifying prompt by prompt from now on", exc)
                        self.rows = False
                    finally:
                        self.client.close_session(target, session)
        return done

    def run(
        self, propose, budget_s: float = 0.0, tick=None, indices: list[int] | None = None, references: bool = True
    ) -> dict:
        """Prompts in order (those of `indices`, else all) until done or past budget_s (0: no limit);
        the figures of those decoded, and their `indices` (a skipped prompt is not among them).
        On rows (_rows): the references first, once per prompt, then `propose`, many prompts a step.
        references False (the clock's passes): no lossless check, and the rows end where they are
        when the budget is spent, so a pass keeps to it within one step (cadence.py)."""
        start, results, refs, decoded = time.perf_counter(), [], [], []
        self.down, self.skipped = set(), 0
        todo = list(range(len(self.prompts)) if indices is None else indices)

        def past_budget() -> bool:
            return budget_s > 0 and time.perf_counter() - start > budget_s

        if self.rows and references:
            missing = [i for i in todo if i not in self._refs]
            self.progress.phase("greedy references", len(missing) * self.max_new_tokens)
            self._refs.update(self._rows(missing, None, tick, past_budget))
        self.progress.phase(getattr(propose, "label", "drafter"), len(todo) * self.max_new_tokens)
        if self.rows:
            ready = [i for i in todo if i in self._refs or not references]
            outs = self._rows(ready, propose, tick, past_budget, end_early=None if references else past_budget)
            for index in todo:
                if index in outs:
                    results.append(outs[index])
                    refs.append(self._refs.get(index))
                    decoded.append(index)
            if self.rows:  # else refused midway: the rest prompt by prompt, below
                self.skipped, todo = len(todo) - len(decoded), []
            else:
                todo = [i for i in todo if i not in outs]
        for index in todo:
            if (results or self.skipped) and past_budget():
                break
            if tick:
                tick()
            prompt = self.prompts[index]
            ref = self._reference(index) if references else None
            if references and ref is None:
                continue
            out = self._attempt(
                index,
                lambda v, prompt=prompt: speculative_generate(
                    v, propose, prompt, max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids
                ),
                features=True,
            )
            if out is not None:
                self.progress.add(len(out.tokens))  # a log line every 10 s while it lasts
                results.append(out)
                refs.append(ref)
                decoded.append(index)
        seconds = time.perf_counter() - start
        return {
            **summarize_sets(results, refs if references else None, [self.names[i] for i in decoded], seconds),
            "skipped": self.skipped,
            "indices": decoded,
            "seconds_per_prompt": round(seconds / max(1, len(results)), 3),
        }
