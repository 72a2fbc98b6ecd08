"""Jobs the launcher runs in child processes (it never imports torch itself): building the demo
target and data (demo.py), measuring what one GPU does in each role for `launcher plan`
(measure_roles.py). Not imported by the workers."""
