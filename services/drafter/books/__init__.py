"""The run's books on drafter rank 0: metrics lines, checkpoints, evaluations and real acceptance at
their steps (bookkeeping.py), the exactly-once batch ledger (ledger.py), metrics.jsonl and TensorBoard
(metrics.py), Weights & Biases (wandb_log.py), and when real acceptance runs by the clock (cadence.py)."""
