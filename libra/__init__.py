"""Libra: disaggregated, asynchronous RL post-training of agentic language models.

The control plane (configs, planner, scheduler, elastic coordinator, CLI) imports without torch or
vLLM; training and rollout engines import them lazily where they are used.
"""

__version__ = "0.1.0"
