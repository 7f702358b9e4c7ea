"""The run's credentials in one process: the shared token, the TLS material and the request bounds.

```
 libra up ──── prepare_run_token(config) ─▶ RUN_DIR/token (0600, new each start) ─▶ children read it
 libra serve ─┐
 libra status ├─ load(config) ─▶ Security ─▶ install() ─▶ libra.rpc: every channel() sends the token;
 plan explain ┘                                            the server (ServiceHost) checks it
```
A service also hands its Security to the processes it starts that call the run (hybrid replicas:
`export_to_children` / `from_environment`), and strips it from those that must not (engine
servers, the Preflight search: `child_environment`). The token comes from, first found: the environment variable `security.auth.env` (LIBRA_TOKEN),
the file `security.auth.file`, RUN_DIR/token. None of them is a `ConfigError` that says how to
make one: a service never runs unauthenticated by accident (`security.auth: none` says so, and
is refused on an interface other than loopback: see libra/rpc.py). Must not know any service.
"""

from __future__ import annotations

import hmac
import os
import pathlib
import re
import secrets
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libra import log as liblog
from libra.errors import ConfigError

if TYPE_CHECKING:
    from libra.config import RunConfig

_log = liblog.get("libra.security")
TOKEN_FILE = "token"
TOKEN_RE = re.compile(r"^[\x21-\x7e]{16,4096}$")
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
MESSAGE_BYTES = 32 * 2**20  # security.limits.message_bytes' default, for a process with nothing installed


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of `security.tls`, read once."""

    cert: bytes
    key: bytes
    ca: bytes | None
    require_client_cert: bool
    server_name: str


@dataclass(frozen=True)
class Security:
    """What a process needs to serve and call Libra services: built once from the config (`load`)."""

    token: str | None  # None: security.auth none
    tls: TlsMaterial | None = None  # None: plaintext
    open_services: frozenset[str] = frozenset()  # full gRPC service names answered without a token
    message_bytes: int = MESSAGE_BYTES

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that authenticates a call."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def bearer_refusal(header: str | None, token: str) -> str:
    """Why an `authorization` header does not carry `token` ("" when it does); constant-time."""
    if not header:
        return ("no token: send the header `authorization: Bearer TOKEN` with the run's token "
                "(RUN_DIR/token, or what security.auth names)")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return "the authorization header must be `Bearer TOKEN`"
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        return "wrong token: this is not the run's token"
    return ""


def check_token(token: str, source: str) -> str:
    token = token.strip()
    if not TOKEN_RE.match(token):
        raise ConfigError(f"the token in {source} must be 16..4096 visible ASCII characters without spaces "
                          f"(got {len(token)} characters); make one with `openssl rand -hex 32`")
    return token


def read_token(config: "RunConfig", env: dict[str, str] | os._Environ = os.environ) -> str:
    """The shared token of `security.auth: token` (see the module docstring for where from)."""
    auth = config.security.auth
    if env.get(auth.env):
        return check_token(env[auth.env], f"${auth.env}")
    path = pathlib.Path(auth.file) if auth.file else config.run_path / TOKEN_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        if auth.file:
            raise ConfigError(f"security.auth.file: {path} does not exist; write the run's token there "
                              f"(`openssl rand -hex 32 > {path}; chmod 600 {path}`)") from None
        raise ConfigError(
            f"security.auth: no token for run {config.run_id}: ${auth.env} is not set and {path} does not exist. "
            f"`libra up` writes one there; for `libra serve`, set ${auth.env} or security.auth.file to the same "
            f"secret on every service (e.g. `openssl rand -hex 32`), or set security.auth: none on a "
            f"loopback-only run") from None
    except OSError as error:
        raise ConfigError(f"security.auth.file: cannot read {path}: {error.strerror}") from None
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        _log.warning("the token file is readable by other users; chmod 600 it", path=str(path), mode=oct(mode & 0o777))
    return check_token(text, str(path))


def _read_pem(path: str, field: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{field}: cannot read {path}: {error.strerror}") from None


def load(config: "RunConfig", env: dict[str, str] | os._Environ = os.environ) -> Security:
    """The process's Security under `config` (raises ConfigError naming the field to fix)."""
    token = read_token(config, env) if config.security.auth.type == "token" else None
    return _build(config.security, token)


def _build(security, token: str | None) -> Security:
    tls = None
    if security.tls.type == "tls":
        t = security.tls
        tls = TlsMaterial(_read_pem(t.cert, "security.tls.cert"), _read_pem(t.key, "security.tls.key"),
                          _read_pem(t.ca, "security.tls.ca") if t.ca else None, t.require_client_cert, t.server_name)
    open_services: set[str] = set()
    if security.auth.type == "token":
        if security.auth.open_health:
            open_services.add(HEALTH_SERVICE)
        if security.auth.open_reflection:
            open_services.update(REFLECTION_SERVICES)
    return Security(token, tls, frozenset(open_services), security.limits.message_bytes)


def prepare_run_token(config: "RunConfig", env: dict[str, str] | os._Environ = os.environ) -> "RunConfig":
    """For `libra up`: unless the token comes from the environment or a configured file, write a new
    random token to RUN_DIR/token (mode 0600; a new one each start) and return the config naming
    that file (the resolved config its services read)."""
    auth = config.security.auth
    if auth.type != "token" or env.get(auth.env) or auth.file:
        return config
    path = config.run_path / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)
    os.replace(staged, path)
    security = config.security.model_copy(update={"auth": auth.model_copy(update={"file": str(path)})})
    return config.model_copy(update={"security": security})


CHILD_ENV = "LIBRA_SECURITY"
"""The `security:` section (JSON) that a service hands to the processes it starts (hybrid replicas),
with the token in the variable that section names."""


def export_to_children(config: "RunConfig", security: Security) -> None:
    """Let the processes this one starts (and that speak gRPC to the run, e.g. hybrid replicas)
    build the same Security: `from_environment()` in the child."""
    section = config.security
    if section.auth.type == "token" and section.auth.file:  # the child reads the variable, not the file
        section = section.model_copy(update={"auth": section.auth.model_copy(update={"file": ""})})
    os.environ[CHILD_ENV] = section.model_dump_json()
    if security.token:
        os.environ[section.auth.env] = security.token


def from_environment(env: dict[str, str] | os._Environ = os.environ) -> Security | None:
    """The Security a parent service exported (`export_to_children`), or None."""
    from libra.security.config import SecurityConfig

    text = env.get(CHILD_ENV)
    if not text:
        return None
    section = SecurityConfig.model_validate_json(text)
    token = None
    if section.auth.type == "token":
        if not env.get(section.auth.env):
            raise ConfigError(f"${CHILD_ENV} asks for a token but ${section.auth.env} is empty")
        token = check_token(env[section.auth.env], f"${section.auth.env}")
    return _build(section, token)


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` without the token and the exported section: for processes that must not call the run
    (engine servers, sandboxed programs)."""
    text = env.get(CHILD_ENV)
    drop = {CHILD_ENV}
    if text:
        from libra.security.config import SecurityConfig

        section = SecurityConfig.model_validate_json(text)
        if section.auth.type == "token":
            drop.add(section.auth.env)
    return {key: value for key, value in env.items() if key not in drop}


def redacted(url: str) -> str:
    """`url` with its password (redis://:PASSWORD@host...) replaced, for logs and messages."""
    return re.sub(r"^([a-z]+://[^:/@]*:)[^@/]*@", r"\1***@", url)


_installed: Security | None = None


def install(security: Security | None) -> None:
    """Make `security` this process's: every `libra.rpc.channel()` then uses it (None: plain channels)."""
    global _installed
    _installed = security


def installed() -> Security | None:
    return _installed


def for_service(config: "RunConfig") -> Security:
    """A service process's Security: loaded, installed for its channels, exported to its children."""
    security = load(config)
    install(security)
    export_to_children(config, security)
    return security
