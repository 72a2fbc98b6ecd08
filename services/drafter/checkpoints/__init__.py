"""What a drafter run keeps: checkpoints written and verified (checkpoint.py), written in the background
(checkpoint_writer.py), shared across hosts (checkpoint_share.py), sized against the free disk
(checkpoint_space.py), and the export to a Hugging Face folder that serving engines load (export.py,
also `launcher export`'s job)."""
