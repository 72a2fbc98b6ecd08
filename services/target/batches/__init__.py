"""What the target serves for training, batch g: JSONL lines read as tokenized documents (data.py,
a chunk of lines per batched tokenizer call in tokenizing.py), packed into rows and cached, batch g
of the run (packing.py), and the captures in flight: device buffers, side-stream copies and pinned
host slots (ring.py). The job that builds the index before the workers start is jobs/pack.py."""
