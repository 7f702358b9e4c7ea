"""Megatron-Core training backend of the trainer (runs in every trainer rank process)."""
