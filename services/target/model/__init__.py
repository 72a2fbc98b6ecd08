"""The target network and its kernels: the frozen HF causal LM loaded, its layer outputs captured
(model.py: Target, load_target), the packed attention that keeps a row's documents apart (attention.py),
the row slot its layers read the documents from (row.py), the Gated DeltaNet layers of the hybrids on
packed rows and in decoding (hybrid.py) with their state across decoding steps (hybrid_states.py),
each decoder layer compiled (compiled.py), and the FP8 linears (fp8.py), the block-scaled FP8
checkpoints (fp8_checkpoint.py) and the FP8 GEMM of a decoding step (fp8_few_tokens.py). Nothing
here knows of sockets, requests or data files."""
