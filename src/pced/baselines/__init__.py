"""Baselines under identical prompts and candidates: all, single (concatenation), ape, mapreduce."""
