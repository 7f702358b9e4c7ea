"""Rollout engines: the processes that serve the policy (vLLM worker + its extension, the
transformers engine and its HTTP server) and the client the gateway talks to them with."""
