"""The target network and its kernels: the frozen HF causal LM loaded, its layer outputs captured
(model.py: Target, load_target), the packed attention that keeps a row's documents apart (attention.py),
the row slot its layers read the documents from (row.py), the Gated DeltaNet layers of the hybrids on
packed rows and in decoding (hybrid.py), each decoder layer compiled (compiled.py), and the FP8
linears and checkpoints (fp8.py) with the FP8 GEMM of a decoding step (fp8_few_tokens.py). Nothing
here knows of sockets, requests or data files."""
