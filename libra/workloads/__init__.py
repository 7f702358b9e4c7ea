"""Agentic workloads: prompts, the tools a model may call, rewards, and demonstrations."""
