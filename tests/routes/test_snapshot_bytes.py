"""The route snapshot's bytes are pinned: a sample cluster (domains with and without middleware, an env
middleware, a rate limit, an L4 port, a VIP, a TCP-only env, unroutable replicas and a canary's weighted
endpoints) must encode to exactly the bytes the builder produced when this test was written. A change of
the builder that is meant to keep the wire format (a faster encoding) must keep this digest; one that
changes the format on purpose updates it."""

from __future__ import annotations

import hashlib

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.builder import RouteBuilder
from shared import keys as K
from shared.version import VERSION
from tests.memory_state import MemoryState
from tests.routes import state as S
from tests.routes.state import DOMAIN, Write, write_local

SAMPLE_SHA256 = "7b7aa4cd5ca459de5bc86a47fb78e00cb0de6e3886876ec15a328c12b4645826"
"""SHA-256 of the sample snapshot's content without its trailing ``control_version`` (the version of the code
that built it), as the builder wrote it at 4a157ad3."""
SAMPLE_BYTES = 1351


def sample() -> list[Write | list[Write]]:
    env_key, env1 = S.env(
        "env1",
        ports=[
            S.http_port(),
            pb.PortSpec(name="db", container_port=5432, protocol=pb.PROTOCOL_TCP, public_l4_port=15432),
        ],
        max_concurrency=20,
        rate_limit=pb.RateLimit(requests_per_second=50, burst=100),
    )
    assert isinstance(env1, pb.Environment)
    env1.middleware.redirect_https = True
    deployment = pb.Deployment(
        environment_id="env1", release_id="relB", previous_release_id="relA", phase=pb.DEPLOYMENT_PHASE_CANARY
    )
    deployment.meta.id = "dep1"
    deployment.canary.step, deployment.canary.weight = 1, 25
    guarded = pb.Middleware(ip_allowlist=["10.0.0.0/8"], basic_auth_username="u", basic_auth_password_hash="$2b$x")
    return [
        S.project(),
        S.app(),
        S.app("app2", "worker"),
        S.node("n1"),
        S.node("n2", mesh_ip=""),
        S.node("n3", status=pb.NODE_STATUS_DOWN, mesh_ip="10.90.0.3"),
        (env_key, env1),
        S.vip("env1", "127.128.0.5"),
        S.domain("dom1", "api.example.com", middleware=guarded),
        S.domain("dom2", "www.example.com", path_prefix="/v2"),
        S.healthy_assignment("a1", "relA", 30001, node_id="n1"),
        S.healthy_assignment("a2", "relA", 30002, node_id="n2"),
        S.assignment("a3", "relB", {"http": 30003, "db": 31003}, node_id="n1"),
        S.healthy_assignment("a4", "relA", 30004, node_id="n3"),
        S.assignment("a5", "relB", {"http": 30005}, node_id="n2", state=pb.INSTANCE_STATE_STARTING),
        (K.deployment("dep1"), deployment),
        S.env("env2", app_id="app2", scale_to_zero=True),
        S.healthy_assignment("b1", "relA", 30011, env_id="env2", node_id="n2"),
        S.env("env3", ports=[pb.PortSpec(name="raw", container_port=9000, protocol=pb.PROTOCOL_TCP)]),
        S.vip("env3", "127.128.0.6"),
        S.assignment("c1", "relA", {"raw": 30021}, env_id="env3", node_id="n1"),
    ]


def test_the_sample_snapshot_keeps_its_bytes() -> None:
    state = MemoryState()
    write_local(state, *sample())
    builder = RouteBuilder(state.store, domain=DOMAIN)
    builder.rebuild_all()
    content = builder.content()
    tail = cpb.RouteSnapshot(control_version=VERSION).SerializeToString(deterministic=True)
    assert content.endswith(tail)
    routes = content[: -len(tail)]  # without the version of the code that built it
    weighted = [e for r in builder.snapshot().http_routes for e in r.endpoints if e.step_tag]
    assert {(e.release_id, e.release_weight, e.step_tag) for e in weighted} == {
        ("relA", 7500, "dep1.1"),
        ("relB", 2500, "dep1.1"),
    }
    assert (hashlib.sha256(routes).hexdigest(), len(routes)) == (SAMPLE_SHA256, SAMPLE_BYTES)
