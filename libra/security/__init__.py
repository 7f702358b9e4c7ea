"""Security of a run: the `security:` config, the shared token and TLS material of a process
(credentials.py), the gRPC gate every server puts in front of its methods (grpc_gate.py) and the
HTTP check of the OpenAI-compatible endpoint and the engines (http.py). docs/operations.md says
how to run with it."""

from libra.security.credentials import (Security, bearer_refusal, for_service, from_environment, install,
                                        installed, load, prepare_run_token, redacted)

__all__ = ["Security", "bearer_refusal", "for_service", "from_environment", "install", "installed", "load",
           "prepare_run_token", "redacted"]
