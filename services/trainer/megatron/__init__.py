"""Megatron-Core training backend of the trainer.

Its modules run in every trainer rank process (global rank 0 serves, the others follow:
`services/trainer/ranks.py`) and in an elastic hybrid replica's process (`elastic.hybrid`), which
builds the same backend with TP = PP = 1 in a one-process world of its own. Each module's
docstring says which of its parts run where.
"""
