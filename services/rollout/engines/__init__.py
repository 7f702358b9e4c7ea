"""Rollout engines: the processes that serve the policy and the gateway's side of them.

    rollout gateway process   vllm_worker.py (launches a vLLM server per worker), client.py (HTTP client)
    vLLM worker process       vllm_ext.py (mixed into vLLM's worker: weight loads, weights group)
    hf engine process         hf_server.py (entry point, HTTP), hf_engine.py (batching), hf_weights.py
"""
