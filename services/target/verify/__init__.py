"""Real acceptance, the target's side: the verify requests of services/net/verify.py (the wire
protocol both roles share; the drafter's side is services/drafter/acceptance/) served on the worker's
own Target. VerifyService bounds the sessions and their share of the GPU (verifying.py); a session is
one prompt decoded incrementally (decode.py: DecodeSession, prefill / verify / commit) or an
evaluation's prompts as rows of one KV cache (row_sessions.py: RowSession, over slots.py's Slots, one
target forward a step for all; the cache, masks and attention of the rows in slot_cache.py), its
steps replayed as CUDA graphs (step_graphs.py). slots.py also decodes `launcher regenerate`'s
prompts (jobs/regenerate_shard.py)."""
