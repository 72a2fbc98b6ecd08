"""The eval's prompts: held-out conversations of the run's data, and the tokens that end an output."""
from __future__ import annotations

import json
from pathlib import Path


def heldout_prompts(cfg, tokenizer, limit: int) -> list[list[int]]:
    """Prompts from the held-out split of the run's data (data.eval_path, else the data.eval_fraction
    lines the target holds out, packing.build_index's rule): each conversation up to its last
    assistant turn, with the chat template's generation prompt. Pre-tokenized lines carry no
    prompt and are skipped. Without a held-out split, the last lines of data.path are used."""
    from services.target.data import normalize_messages
    from services.target.packing import held_out_indices

    d = cfg.data
    path = d.eval_path or d.path
    lines = [t for t in Path(path).read_text(encoding="utf-8").splitlines() if t.strip()]
    if not d.eval_path:
        if d.eval_fraction > 0 and len(lines) > 1:
            # the same choice as the target's split (exact when no line is skipped as bad)
            lines = [lines[i] for i in held_out_indices(len(lines), d.eval_fraction, cfg.run.seed)]
        else:
            lines = lines[::-1]
    prompts = []
    for text in lines:
        if len(prompts) >= limit:
            break
        try:
            record = json.loads(text)
            messages = normalize_messages(record) if ("messages" in record or "conversations" in record) else None
        except Exception:
            continue
        if not messages:
            continue
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = tokenizer.apply_chat_template(messages[:last], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        prompts.append(list(ids))
    return prompts


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's eos and the HF model's generation_config eos ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)
