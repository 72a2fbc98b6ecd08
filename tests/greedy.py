"""The tests' outside reference for greedy decoding: transformers' own generate."""

import torch


@torch.no_grad()
def hf_greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids=()) -> list[int]:
    """HF generate, plain greedy, one token per forward; the output ends at the first stop token."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    stops = list(stop_ids)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    new = out[0, len(prompt_ids) :].tolist()
    for n, token in enumerate(new):
        if token in stops:
            return new[: n + 1]
    return new
