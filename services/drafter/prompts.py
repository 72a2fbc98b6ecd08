"""The eval's prompts: held-out conversations of the run's data, and the tokens that end an output."""
from __future__ import annotations


def heldout_prompts(cfg, tokenizer, limit: int) -> list[list[int]]:
    """Token ids of the held-out conversations (packing.heldout_chats: up to their last assistant
    turn), with the chat template's generation prompt."""
    from services.target.data import prompt_tokens
    from services.target.packing import heldout_chats
    return [prompt_tokens(tokenizer, messages, cfg.data.chat_template_kwargs) for messages in heldout_chats(cfg, limit)]


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's eos and the HF model's generation_config eos ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)
