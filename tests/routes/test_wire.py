"""The route builder's hand-written wire encoding equals protobuf's own, on random routing states.

:func:`tests.routes.reference.reference_content` builds the same snapshot the straightforward way, with
the generated message classes; the builder's bytes must be exactly its deterministic serialization (long
and non-ASCII strings, uint64 extremes, middleware, rate limits, L4 ports and VIPs included).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.builder import RouteBuilder
from services.routes.wire import LEN, VARINT, len_field, string_field, tag, uint_field
from tests.memory_state import MemoryState
from tests.routes import state as S
from tests.routes.reference import reference_content
from tests.routes.state import Write, write_local

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


# ------------------------------------------------------------------------------------------ strategies

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=140)
short = st.sampled_from(["", "a", "web", "api-é", "x" * 130])
port_names = st.sampled_from(["", "http", "grpc", "admin"])


@st.composite
def routing_states(draw: st.DrawFn) -> tuple[list[Write | list[Write]], str]:
    nodes = [f"n{i}" for i in range(3)]
    writes: list[Write | list[Write]] = [S.project("proj", draw(short)), S.app("app", draw(text))]
    for node_id in nodes:
        status = draw(st.sampled_from([pb.NODE_STATUS_ALIVE, pb.NODE_STATUS_DOWN, pb.NODE_STATUS_DRAINING]))
        writes.append(S.node(node_id, status=status, mesh_ip=draw(st.sampled_from(["", "10.90.0.7"]))))
    for e in range(draw(st.integers(1, 3))):
        env_id = f"env{e}"
        ports = [
            pb.PortSpec(
                name=draw(port_names),
                container_port=draw(st.integers(0, UINT32)),
                protocol=draw(st.sampled_from([pb.PROTOCOL_HTTP, pb.PROTOCOL_TCP, pb.PROTOCOL_UNSPECIFIED])),
                public_l4_port=draw(st.sampled_from([0, 1, 5432, UINT32])),
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        rate_limit = draw(st.none() | st.builds(pb.RateLimit, requests_per_second=st.integers(0, UINT32)))
        service: dict[str, object] = {
            "scale_to_zero": draw(st.booleans()),
            "max_concurrency": draw(st.sampled_from([0, 1, 200, UINT32])),
        }
        if rate_limit is not None:
            service["rate_limit"] = rate_limit
        writes.append(
            S.env(
                env_id,
                app_id=draw(st.sampled_from(["app", "missing-app"])),
                name=draw(text),
                ports=ports,
                route_generation=draw(st.sampled_from([0, 1, UINT64])),
                **service,
            )
        )
        if draw(st.booleans()):
            writes.append(S.vip(env_id, draw(st.sampled_from(["", "127.128.0.9"]))))
        for d in range(draw(st.integers(0, 2))):
            middleware = draw(
                st.none()
                | st.builds(pb.Middleware, redirect_https=st.booleans(), max_body_bytes=st.integers(0, UINT64))
            )
            writes.append(
                S.domain(
                    f"dom-{env_id}-{d}",
                    draw(text),
                    env_id=env_id,
                    project_id=draw(st.sampled_from(["proj", "other"])),
                    path_prefix=draw(short),
                    port_name=draw(port_names),
                    middleware=middleware,
                )
            )
        for r in range(draw(st.integers(0, 3))):
            bindings = {name: draw(st.integers(1, 65535)) for name in draw(st.lists(port_names, max_size=3))}
            writes.append(
                S.assignment(
                    f"a-{env_id}-{r}",
                    draw(st.sampled_from(["relA", "relB"])),
                    bindings,
                    env_id=env_id,
                    node_id=draw(st.sampled_from([*nodes, "gone"])),
                    state=draw(st.sampled_from([pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_STARTING])),
                )
            )
    return writes, draw(st.sampled_from(["", "apps.example.com"]))


@settings(max_examples=300, deadline=None)
@given(routing_states())
def test_hand_encoded_snapshot_equals_protobufs_serialization(case: tuple[list[Write | list[Write]], str]) -> None:
    writes, domain = case
    local = MemoryState()
    write_local(local, *writes)
    builder = RouteBuilder(local.store, domain=domain)
    builder.rebuild_all()
    assert builder.content() == reference_content(local.store, domain)


@given(st.integers(0, UINT64))
def test_uint_field_matches_protobuf(value: int) -> None:
    field_tag = tag(cpb.HTTPRoute.ROUTE_GENERATION_FIELD_NUMBER, VARINT)
    assert uint_field(field_tag, value) == cpb.HTTPRoute(route_generation=value).SerializeToString()


@given(st.text(max_size=300))
def test_string_field_matches_protobuf_for_any_length(value: str) -> None:
    field_tag = tag(cpb.HTTPRoute.HOSTNAME_FIELD_NUMBER, LEN)
    assert string_field(field_tag, value) == cpb.HTTPRoute(hostname=value).SerializeToString()


@given(st.lists(st.text(max_size=40), max_size=8))
def test_len_field_frames_a_sub_message_like_protobuf(allowlist: list[str]) -> None:
    middleware = pb.Middleware(ip_allowlist=allowlist)
    field_tag = tag(cpb.HTTPRoute.MIDDLEWARE_FIELD_NUMBER, LEN)
    framed = len_field(field_tag, middleware.SerializeToString(deterministic=True))
    assert framed == cpb.HTTPRoute(middleware=middleware).SerializeToString(deterministic=True)
