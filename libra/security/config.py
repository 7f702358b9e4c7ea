"""Typed config of the `security:` section: who may call a service, over what, and how much.

```yaml
security:
  auth: token            # or {type: token, file: /run/secrets/libra_token, env: LIBRA_TOKEN}, or none
  tls: plaintext         # or {cert: server.pem, key: server.key, ca: ca.pem, require_client_cert: true}
  listen_host: ""        # "": the host of the service's own address (127.0.0.1 by default)
  limits: {message_bytes: 33554432, max_gpus: 16384, preflight_timeout_s: 120, max_workers: 1024}
```
Read by libra/security/credentials.py (the token and TLS material), libra/rpc.py (the server and
its channels) and the services that bound their inputs. Must not know any service.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, field_validator

from libra.configbase import Section, tagged_union

TOKEN_ENV = "LIBRA_TOKEN"


class TokenAuth(Section):
    """Every RPC (and the OpenAI-compatible endpoint) carries `authorization: Bearer TOKEN`."""

    type: Literal["token"] = Field("token", description="token: a shared secret authenticates every call")
    file: str = Field("", description="file holding the token (mode 0600); empty: the variable `env`, else "
                                      "RUN_DIR/token (what `libra up` writes)")
    env: str = Field(TOKEN_ENV, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=128,
                     description="environment variable holding the token; it wins over `file` when set")
    open_health: bool = Field(True, description="answer grpc.health.v1.Health without a token (probes, compose)")
    open_reflection: bool = Field(True, description="answer server reflection without a token (`grpcurl list`)")


class NoAuth(Section):
    """No authentication: refused unless every service listens on loopback only."""

    type: Literal["none"] = Field("none", description="none: anyone who reaches a port may call every RPC")


class Plaintext(Section):
    """gRPC without TLS (the token still travels in clear: keep it on a trusted network)."""

    type: Literal["plaintext"] = Field("plaintext", description="plaintext: no TLS")


class Tls(Section):
    """TLS on every gRPC server and channel of the run (mutual TLS with require_client_cert)."""

    type: Literal["tls"] = Field("tls", description="tls: encrypt and authenticate the servers")
    cert: str = Field(..., min_length=1, description="PEM certificate of this service (also its client "
                                                     "certificate toward its peers)")
    key: str = Field(..., min_length=1, description="PEM private key of `cert`")
    ca: str = Field("", description="PEM bundle that signed the peers' certificates; empty: the system's roots")
    require_client_cert: bool = Field(False, description="servers accept only clients with a certificate "
                                                         "signed by `ca` (mutual TLS; needs `ca`)")
    server_name: str = Field("", description="name to expect in the servers' certificates; empty: the host "
                                             "of the address called")

    @field_validator("require_client_cert")
    @classmethod
    def _needs_ca(cls, value: bool, info) -> bool:
        if value and not info.data.get("ca"):
            raise ValueError("security.tls.require_client_cert needs security.tls.ca (the CA of the clients)")
        return value


AuthConfig = tagged_union("security.auth", TokenAuth, NoAuth, default="token")
TlsConfig = tagged_union("security.tls", Plaintext, Tls, default="tls")


class Limits(Section):
    """Bounds on what one request may ask for (inputs beyond them get INVALID_ARGUMENT)."""

    message_bytes: int = Field(32 * 2**20, ge=2**20, le=2**30,
                               description="largest gRPC message a service receives or sends (bytes)")
    max_gpus: int = Field(16_384, ge=2, le=1_000_000,
                          description="most GPUs a request may name: Preflight's gpus, the GPUs of a plan "
                                      "set with SetPlan or sent to ApplyPlan")
    preflight_timeout_s: float = Field(120.0, gt=0, le=3600,
                                       description="a Preflight search past this is stopped (DEADLINE_EXCEEDED)")
    max_workers: int = Field(1024, ge=1, le=100_000,
                             description="rollout workers one gateway may run; StartWorkers beyond it is refused")


class SecurityConfig(Section):
    """Authentication, transport security, the interface services listen on, and request bounds."""

    auth: AuthConfig = Field(default_factory=TokenAuth, description="how callers authenticate: token or none")
    tls: TlsConfig = Field(default_factory=Plaintext, description="plaintext or tls (certificates)")
    listen_host: str = Field("", max_length=253, description="interface every service (and its metrics) listens on "
                                             "(LIBRA_LISTEN_HOST); empty: the host of its own address (0.0.0.0 "
                                             "in containers)")
    limits: Limits = Field(default_factory=Limits, description="bounds on requests")

    @field_validator("listen_host")
    @classmethod
    def _host(cls, value: str) -> str:
        if value and not (_is_ip(value.strip("[]")) or HOSTNAME_RE.match(value)):
            raise ValueError(f"security.listen_host must be a host name or an IP address (no port), got {value!r}")
        return value


HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
