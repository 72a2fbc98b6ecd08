"""The target's jobs that run as programs of their own (services/process/jobs.py's table), not in the
worker: the packing job that tokenizes and packs a run's data before any worker starts (pack.py), and
one shard of `launcher regenerate`, the target rewriting a chat file's assistant turns (regenerate_shard.py)."""
