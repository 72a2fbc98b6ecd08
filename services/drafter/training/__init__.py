"""One drafter rank's training: the step (train.py: anchors and blocks, the drafter, the chunked loss,
DDP, AdamW), the core that runs it with no sockets, signals or health (core.py), the compile warm-up
(warmup.py), held-out evaluation by loss, accuracy and simulated τ (evaluate.py), and where batches come
from (source.py: pulled from the targets over ZeroMQ; synthetic.py: fixed-seed batches for --synthetic)."""
