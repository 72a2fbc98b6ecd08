"""The drafter model, as plain as nanoGPT: the DFlash block drafter (model.py) with its attention
(attention.py: flex on CUDA, dense on CPU), the anchors and the block mask (anchors.py), Domino's
causal correction head (domino.py), the target's frozen embedding and lm_head (target_head.py), the
FP8 linears (precision.py) and the loss (loss.py). Nothing here knows of processes, sockets or files."""
