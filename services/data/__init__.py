"""The data as both roles read it: the lines of a JSONL file, the packed rows, one batch, the eval's prompts."""
