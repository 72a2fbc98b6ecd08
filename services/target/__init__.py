"""The target role: the process shell (worker.py, `python -m services.target`) and the core it drives
(core.py: TargetCore.answer(request) -> replies.py's replies, no socket), over four packages by concern:
model/ (the network and its kernels), batches/ (the data, packed rows and captures served for
training), verify/ (real acceptance, the target's side) and jobs/ (packing and regeneration, run as
programs of their own). The core stays at the top: it is the one place that puts the packages together."""
