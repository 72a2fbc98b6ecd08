"""Real acceptance, the drafter's side: speculative decoding of prompts with a drafter and the target's
verdicts (speculative.py), one evaluation of drafters on a prompt set with its controls (spec_eval.py),
and the target workers as the verifier during training (remote_eval.py; the target's side is
services/target/verify/verifying.py, the protocol services/net/verify.py)."""
