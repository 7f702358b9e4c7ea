"""Authentication and exposure (docs/operations.md, "Security"): the token on every RPC of every
service (streams included) and on the OpenAI-compatible endpoint, the engine key, TLS and mutual
TLS, the interface a service listens on, and where the token comes from."""

from __future__ import annotations

import asyncio
import collections
import datetime
import ipaddress
import os
import pathlib
import stat
import types

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from libra.config import build_run_config
from libra.errors import ConfigError, FailedPrecondition
from libra.rpc import ServiceHost, channel, wire_services
from libra.security import Security, from_environment, install, load, prepare_run_token
from libra.security.credentials import HEALTH_SERVICE, REFLECTION_SERVICES, TlsMaterial, child_environment
from libra.security.config import SecurityConfig
from libra.v1 import planner_pb2, planner_pb2_grpc
from tests.service.rpc_probes import Harness

TOKEN = "tok-" + "0123456789abcdef" * 2
OPEN = frozenset({HEALTH_SERVICE, *REFLECTION_SERVICES})
SECURITY = Security(token=TOKEN, open_services=OPEN)
SERVICES = {service.name: service for service in wire_services()}


async def _call(chan: grpc.aio.Channel, method, payload: bytes, metadata=()) -> tuple[grpc.StatusCode, str]:
    """Call `method` with raw request bytes; the status it ends with (OK if it answers) and why."""
    path, same = f"/{method.containing_service.full_name}/{method.name}", (lambda data: data)
    try:
        if method.client_streaming:
            call = chan.stream_stream(path, request_serializer=same, response_deserializer=same)(
                iter([payload]), metadata=metadata, timeout=5)
            async for _ in call:
                break
        elif method.server_streaming:
            call = chan.unary_stream(path, request_serializer=same, response_deserializer=same)(
                payload, metadata=metadata, timeout=5)
            async for _ in call:
                break
        else:
            await chan.unary_unary(path, request_serializer=same, response_deserializer=same)(
                payload, metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_rpc_refuses_a_missing_or_wrong_token_and_takes_the_right_one(name, run_id, store, arun, tmp_path):
    service = SERVICES[name]

    async def scenario():
        async with Harness(service, run_id, store, tmp_path, SECURITY) as harness:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.port}") as bare:
                for method in service.methods:
                    empty = b""  # a valid (empty) request: the token is checked before it is parsed
                    missing = await _call(bare, method, empty)
                    assert missing[0] == grpc.StatusCode.UNAUTHENTICATED and "no token" in missing[1], method.name
                    wrong = await _call(bare, method, empty, (("authorization", f"Bearer {TOKEN[:-1]}x"),))
                    assert wrong[0] == grpc.StatusCode.UNAUTHENTICATED and "wrong token" in wrong[1], method.name
                    basic = await _call(bare, method, empty, (("authorization", f"Basic {TOKEN}"),))
                    assert basic[0] == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in basic[1], method.name
                    right = await _call(bare, method, empty, (("authorization", f"Bearer {TOKEN}"),))
                    assert right[0] != grpc.StatusCode.UNAUTHENTICATED, (method.name, right)
                    through = await _call(harness.channel, method, empty)  # channel(security=...) sends it
                    assert through[0] != grpc.StatusCode.UNAUTHENTICATED, (method.name, through)
    arun(scenario())


def test_health_and_reflection_are_open_unless_closed(arun):
    async def scenario(open_services):
        host = ServiceHost("planner", ["libra.v1.Planner"], 0, "127.0.0.1", Security(TOKEN, None, open_services))
        port = await host.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
                try:
                    health = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    health = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
                except grpc.aio.AioRpcError as error:
                    health = error.code()
                call = reflection_pb2_grpc.ServerReflectionStub(bare).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                try:
                    listed = [s.name async for reply in call for s in reply.list_services_response.service]
                except grpc.aio.AioRpcError as error:
                    listed = error.code()
            return health, listed
        finally:
            await host.stop(0)

    health, listed = arun(scenario(OPEN))
    assert health == "NOT_SERVING" and "libra.v1.Planner" in listed
    assert arun(scenario(frozenset())) == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED)


def test_a_request_that_does_not_parse_is_invalid_argument_not_unknown(run_id, store, arun, tmp_path):
    async def scenario():
        async with Harness(SERVICES["Planner"], run_id, store, tmp_path, SECURITY) as harness:
            method = SERVICES["Planner"].methods_by_name["GetPlan"]
            return await _call(harness.channel, method, b"\xff\xff\xff")
    code, details = arun(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in details


def test_channels_send_the_token_this_process_installed(run_id, store, arun, tmp_path):
    async def scenario():
        async with Harness(SERVICES["Planner"], run_id, store, tmp_path, SECURITY) as harness:
            address = f"127.0.0.1:{harness.port}"
            request = planner_pb2.ExplainRequest(run_id=run_id)
            try:
                async with channel(address) as chan:
                    await planner_pb2_grpc.PlannerStub(chan).Explain(request, timeout=5)
            except grpc.aio.AioRpcError as error:
                before = error.code()
            install(SECURITY)
            try:
                async with channel(address) as chan:
                    await planner_pb2_grpc.PlannerStub(chan).Explain(request, timeout=5)
                after = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                after = error.code()
            finally:
                install(None)
            return before, after
    before, after = arun(scenario())
    assert before == grpc.StatusCode.UNAUTHENTICATED and after != grpc.StatusCode.UNAUTHENTICATED


def _certificates(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name: str, issuer_key, issuer_name, ca: bool, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        certificate = builder.sign(issuer_key or key, hashes.SHA256())
        return key, certificate

    ca_key, ca_cert = issue("libra-test-ca", None, None, True)
    files = {}
    for name, san in (("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                      ("client", [x509.DNSName("libra-client")])):
        key, cert = issue(name, ca_key, ca_cert.subject, False, san)
        files[f"{name}.key"] = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption())
        files[f"{name}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
    files["ca.pem"] = ca_cert.public_bytes(serialization.Encoding.PEM)
    paths = {}
    for name, data in files.items():
        paths[name] = directory / name
        paths[name].write_bytes(data)
    return paths


def test_tls_and_mutual_tls(tmp_path, arun):
    pem = _certificates(tmp_path)
    read = {name: path.read_bytes() for name, path in pem.items()}
    server = Security(TOKEN, TlsMaterial(read["server.pem"], read["server.key"], read["ca.pem"], True, ""), OPEN)
    client = Security(TOKEN, TlsMaterial(read["client.pem"], read["client.key"], read["ca.pem"], False, ""), OPEN)
    (tmp_path / "other").mkdir()
    stranger = _certificates(tmp_path / "other")  # a client certificate of another CA
    other = Security(TOKEN, TlsMaterial(stranger["client.pem"].read_bytes(), stranger["client.key"].read_bytes(),
                                        read["ca.pem"], False, ""), OPEN)

    async def scenario():
        host = ServiceHost("planner", ["libra.v1.Planner"], 0, "127.0.0.1", server)
        port = await host.start()
        outcomes = {}
        try:
            for name, security in (("mtls", client), ("foreign-ca", other), ("plaintext", None)):
                if security is None:
                    chan = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                else:
                    chan = channel(f"127.0.0.1:{port}", security=security)
                async with chan:
                    try:
                        await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=3)
                        outcomes[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as error:
                        outcomes[name] = error.code()
        finally:
            await host.stop(0)
        return outcomes

    outcomes = arun(scenario())
    assert outcomes == {"mtls": grpc.StatusCode.OK, "foreign-ca": grpc.StatusCode.UNAVAILABLE,
                        "plaintext": grpc.StatusCode.UNAVAILABLE}
    config = build_run_config({"security": {"tls": {"cert": str(pem["server.pem"]), "key": str(pem["server.key"]),
                                                    "ca": str(pem["ca.pem"]), "require_client_cert": True}}},
                              env={"LIBRA_TOKEN": TOKEN})
    loaded = load(config, env={"LIBRA_TOKEN": TOKEN})
    assert loaded.tls == server.tls and loaded.token == TOKEN
    with pytest.raises(ConfigError, match="security.tls.cert"):
        load(build_run_config({"security": {"tls": {"cert": str(tmp_path / "none.pem"), "key": "k"}}}, env={}),
             env={"LIBRA_TOKEN": TOKEN})


def test_no_token_is_refused_off_loopback_and_services_listen_where_configured(arun):
    async def start(host: str, security: Security):
        server = ServiceHost("planner", ["libra.v1.Planner"], 0, host, security)
        try:
            await server.start()
        finally:
            await server.stop(0)

    with pytest.raises(FailedPrecondition, match="security.auth is none"):
        arun(start("0.0.0.0", Security(token=None)))
    arun(start("127.0.0.1", Security(token=None)))  # loopback: allowed (a run on one machine, by choice)
    config = build_run_config({}, env={})
    assert [config.listen_host_of(s) for s in ("planner", "trainer")] == ["127.0.0.1", "127.0.0.1"]
    moved = build_run_config({"addresses": {"planner": "planner:50051"}}, env={})
    assert moved.listen_host_of("planner") == "planner"
    assert build_run_config({"security": {"listen_host": "0.0.0.0"}}, env={}).listen_host_of("planner") == "0.0.0.0"
    with pytest.raises(ConfigError, match="listen_host"):
        build_run_config({"security": {"listen_host": "0.0.0.0:80"}}, env={})


def test_where_the_token_comes_from(tmp_path, monkeypatch):
    config = build_run_config({"run_dir": str(tmp_path / "run")}, env={})
    with pytest.raises(ConfigError, match="libra up` writes one there"):
        load(config, env={})
    with pytest.raises(ConfigError, match="16..4096"):
        load(config, env={"LIBRA_TOKEN": "short"})
    assert load(config, env={"LIBRA_TOKEN": TOKEN}).token == TOKEN
    prepared = prepare_run_token(config, env={})  # what `libra up` does
    path = pathlib.Path(prepared.security.auth.file)
    assert path == tmp_path / "run" / "token" and stat.S_IMODE(path.stat().st_mode) == 0o600
    first = load(prepared, env={}).token
    assert load(config, env={}).token == first  # RUN_DIR/token: what `libra status` finds
    assert load(prepare_run_token(config, env={}), env={}).token != first  # a new one each start
    assert prepare_run_token(config, env={"LIBRA_TOKEN": TOKEN}) is config  # the environment's wins: no file
    assert load(config, env={"LIBRA_TOKEN": TOKEN}).token == TOKEN
    named = build_run_config({"security": {"auth": {"file": str(tmp_path / "absent")}}}, env={})
    with pytest.raises(ConfigError, match="security.auth.file"):
        load(named, env={})
    assert load(build_run_config({"security": {"auth": "none"}}, env={}), env={}).token is None


def test_a_service_hands_its_security_to_the_processes_it_starts(tmp_path, monkeypatch):
    from libra.security.credentials import CHILD_ENV, export_to_children

    monkeypatch.setenv(CHILD_ENV, "")  # set here, so that the test's end puts both back as they were
    monkeypatch.setenv("LIBRA_TOKEN", "")
    config = build_run_config({"run_dir": str(tmp_path)}, env={})
    export_to_children(config, Security(TOKEN, open_services=OPEN))
    child = from_environment(dict(os.environ))
    assert child is not None and child.token == TOKEN and child.open_services == OPEN
    stripped = child_environment(dict(os.environ))  # what an engine server gets
    assert CHILD_ENV not in stripped and "LIBRA_TOKEN" not in stripped
    assert SecurityConfig.model_validate_json(os.environ[CHILD_ENV]).auth.file == ""


def test_the_openai_endpoint_takes_the_token_as_its_api_key(arun):
    from libra.services.rollout.config import RolloutConfig
    from libra.services.rollout.openai_gateway import OpenAIGateway

    config = RolloutConfig(openai_endpoint={"enabled": True, "port": 0})
    service = types.SimpleNamespace(cfg=config, runner=None, counters=collections.Counter())

    async def scenario():
        install(SECURITY)
        try:
            gateway = await OpenAIGateway(service).start()
        finally:
            install(None)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=10) as http:
                bare = await http.get("/v1/models")
                wrong = await http.get("/v1/models", headers={"Authorization": "Bearer " + "x" * 40})
                right = await http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
                claim = await http.post("/v1/libra/trajectories/claim", json={})
        finally:
            await gateway.close()
        return bare, wrong, right, claim

    bare, wrong, right, claim = arun(scenario())
    assert bare.status_code == wrong.status_code == claim.status_code == 401
    assert bare.json()["error"]["type"] == "authentication_error" and "no token" in bare.json()["error"]["message"]
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "policy"


def test_the_engine_key_guards_every_engine_path_but_health(monkeypatch):
    from libra.services.rollout.engines import engine_auth

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def status(path: str, headers: dict[str, str]) -> int:
        sent = []

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "path": path, "method": "POST",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        await middleware(scope, None, send)
        return sent[0]["status"]

    monkeypatch.delenv(engine_auth.KEY_ENV, raising=False)
    with pytest.raises(SystemExit, match=engine_auth.KEY_ENV):
        engine_auth.EngineKeyMiddleware(app)  # an engine never serves without its key
    monkeypatch.setenv(engine_auth.KEY_ENV, engine_auth.process_key())
    middleware = engine_auth.EngineKeyMiddleware(app)
    for path in ("/collective_rpc", "/v1/completions", "/pause", "/sleep", "/reset_prefix_cache", "/metrics"):
        assert asyncio.run(status(path, {})) == 401
        assert asyncio.run(status(path, {"Authorization": f"Bearer {TOKEN}"})) == 401  # the run's token: no
        assert asyncio.run(status(path, engine_auth.headers())) == 200
    assert asyncio.run(status("/health", {})) == 200
