"""Speculative decoding's shared parts: a verify step and its record, progress lines, the lossless
rule and acceptance in words."""
