"""A worker as a process: its bootstrap, health, stopping and exit codes, its log, systemd's
notifications, the jobs the launcher may start, and the per-process setup (compile, torchao, GGUF)."""
