"""RouteBuilder: the routing table as a pure function of the state view.

Construction: per environment
(sorted by id) whose app exists, one HTTP route per explicit domain of the env's project attached to
it (domain id order), then the implicit ``<app>-<env>.<domain>`` route — only towards an HTTP port: an env
whose ports are all TCP/UDP gets no HTTP route (nor a certificate); L4 routes for ports with a
public port; an internal service when the env holds a VIP; endpoints are the active release's RUN
replicas observed HEALTHY with a bound mesh port on a node that is present and not DOWN/DRAINED.

Incremental: the snapshot is kept as per-environment fragments (``env_routes.py``), each already in wire encoding
(written by hand, :mod:`services.routes.wire`, several times cheaper than building message objects),
and the snapshot bytes are their concatenation. Protobuf's wire format makes this exact: a message's
deterministic encoding is its fields in number order, a repeated field being its elements' encodings
back to back, so ``version`` + every env's ``http_routes`` + every env's ``l4_routes`` + every env's
``internal_services`` + ``cert_hosts`` + ``cluster`` + ``control_version`` is byte for byte
``SerializeToString(deterministic=True)`` of the whole snapshot. A change rebuilds only the environments
whose inputs it touches:

* env, vip → that env;  app, project → the envs of that app / project;
* domain → the env it is attached to now and the one it was attached to before;
* assignment (the view also reports observed reports joined into it) → its env, old and new;
* node (status, mesh IP) → every env with an assignment on that node;
* deployment → its env (a canary's weights: endpoints of both releases, each with its release's share).

App and Project changes are watched (a rename reaches the routes at once, not on the tick), and the
build is atomic (it runs between two view updates, never across one).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.env_routes import EnvRoutes, build_env_routes, encode_snapshot, node_hosts, routable_host
from shared import keys as K
from shared.state.changes import Change
from shared.state.reader import StateReader
from shared.version import VERSION

RELEVANT_KINDS = frozenset({K.ENV, K.APP, K.PROJECT, K.DOMAIN, K.ASSIGNMENT, K.OBSERVED, K.NODE, K.VIP, K.DEPLOYMENT})
"""Every kind the snapshot reads; the snapshot version is the newest revision among them."""


class RouteBuilder:
    """Keeps the route snapshot of a view up to date, rebuilding only the environments a change touches.

    Call :meth:`rebuild_all` once the view is loaded, then :meth:`apply_changes` with the view's change
    feed (kinds :data:`RELEVANT_KINDS`). :meth:`content` is the version-less snapshot encoding;
    :attr:`revision` the state revision it reflects.
    """

    def __init__(self, view: StateReader, *, domain: str, cluster: cpb.ClusterIdentity | None = None) -> None:
        self.view = view
        self.domain = domain
        self.envs_rebuilt = 0
        self.cluster = cluster if cluster is not None else cpb.ClusterIdentity()
        self._reset()

    @property
    def cluster(self) -> cpb.ClusterIdentity:
        """The cluster the snapshot names (``RouteSnapshot.cluster``, after ``cert_hosts``: in the content's tail)."""
        return cpb.RouteSnapshot.FromString(self._tail).cluster

    @cluster.setter
    def cluster(self, identity: cpb.ClusterIdentity) -> None:
        # The last fields, in number order: cluster (330), then the routes leader's version (440).
        snapshot = cpb.RouteSnapshot(control_version=VERSION)
        if identity.ByteSize():  # unnamed (tests, a bare builder): the field is left out
            snapshot.cluster.CopyFrom(identity)
        self._tail = snapshot.SerializeToString(deterministic=True)
        self._content: bytes | None = None

    def _reset(self) -> None:
        self._routes: dict[str, EnvRoutes] = {}
        self._order: list[str] = []  # ids of the envs with routes, sorted
        # Each env's sections, aligned with _order: the snapshot is their concatenation.
        self._http_parts: list[bytes] = []
        self._l4_parts: list[bytes] = []
        self._internal_parts: list[bytes] = []
        self._node_hosts: dict[str, str | None] = {}
        self._host_refs: dict[str, int] = {}  # hostname -> number of routes carrying it
        self._cert_hosts: list[str] = []  # the keys of _host_refs, sorted
        self._cert_hosts_bytes: bytes | None = None
        self._content = None
        # Dependency indexes: which envs a change of a given object affects.
        self._env_inputs: dict[str, tuple[str, str]] = {}  # env -> (app_id, project_id)
        self._envs_by_app: dict[str, set[str]] = defaultdict(set)
        self._envs_by_project: dict[str, set[str]] = defaultdict(set)
        self._domain_env: dict[str, str] = {}
        # assignment -> env, to find the env of an assignment the view no longer holds
        self._assignment_env: dict[str, str] = {}

    # ------------------------------------------------------------------ reading

    @property
    def revision(self) -> int:
        """Newest state revision (put or delete) among the kinds the snapshot reads."""
        return max(self.view.kind_revision(kind) for kind in RELEVANT_KINDS)

    def content(self) -> bytes:
        """The snapshot without its version (which :func:`encode_snapshot` prepends)."""
        if self._content is None:
            if self._cert_hosts_bytes is None:
                self._cert_hosts_bytes = cpb.RouteSnapshot(cert_hosts=self._cert_hosts).SerializeToString(
                    deterministic=True
                )
            sections = (self._http_parts, self._l4_parts, self._internal_parts)
            self._content = b"".join([*(b"".join(parts) for parts in sections), self._cert_hosts_bytes, self._tail])
        return self._content

    def snapshot(self, version: int | None = None) -> cpb.RouteSnapshot:
        """The snapshot as a message (tests, CLI); ``version`` defaults to :attr:`revision`."""
        snapshot = cpb.RouteSnapshot()
        snapshot.ParseFromString(encode_snapshot(self.revision if version is None else version, self.content()))
        return snapshot

    # ------------------------------------------------------------------ building

    def rebuild_all(self) -> None:
        """Forget everything and build every environment from the view."""
        self._reset()
        self._node_hosts = node_hosts(self.view)
        self._assignment_env = {a.meta.id: a.environment_id for a in self.view.assignments()}
        for dom in self.view.domains():
            self._domain_env[dom.meta.id] = dom.environment_id
        for env in self.view.envs():
            env_id = env.meta.id
            self.envs_rebuilt += 1
            self._index_env(env_id, env)
            routes = build_env_routes(self.view, env, self.domain, self._node_hosts)
            if routes is not None:
                self._routes[env_id] = routes
                for host in routes.hostnames:
                    self._host_refs[host] = self._host_refs.get(host, 0) + 1
        self._order = sorted(self._routes)
        ordered = [self._routes[env_id] for env_id in self._order]
        self._http_parts = [routes.http for routes in ordered]
        self._l4_parts = [routes.l4 for routes in ordered]
        self._internal_parts = [routes.internal for routes in ordered]
        self._cert_hosts = sorted(self._host_refs)

    def apply_changes(self, changes: Iterable[Change]) -> set[str]:
        """Rebuild the environments affected by ``changes``; returns their ids."""
        affected: set[str] = set()
        for kind, ident in changes:
            if kind in (K.ENV, K.VIP):
                affected.add(ident)
            elif kind == K.APP:
                affected |= self._envs_by_app.get(ident, set())
            elif kind == K.PROJECT:
                affected |= self._envs_by_project.get(ident, set())
            elif kind == K.DOMAIN:
                affected |= self._move_domain(ident)
            elif kind in (K.ASSIGNMENT, K.OBSERVED):
                affected |= self._place_assignment(ident, self.view.assignment(ident))
            elif kind == K.DEPLOYMENT:  # a canary's step and weight (issue 41)
                deployment = self.view.deployment(ident)
                if deployment is not None:
                    affected.add(deployment.environment_id)
            elif kind == K.NODE:
                host = routable_host(self.view.node(ident))
                if self._node_hosts.get(ident) != host:
                    self._node_hosts[ident] = host
                    affected |= {a.environment_id for a in self.view.assignments_by_node(ident)}
        for env_id in affected:
            self._rebuild_env(env_id)
        return affected

    def _move_domain(self, domain_id: str) -> set[str]:
        affected = set()
        before = self._domain_env.pop(domain_id, None)
        if before is not None:
            affected.add(before)
        dom = self.view.get(K.DOMAIN, domain_id)
        if isinstance(dom, pb.Domain):
            self._domain_env[domain_id] = dom.environment_id
            affected.add(dom.environment_id)
        return affected

    def _place_assignment(self, assignment_id: str, assignment: pb.Assignment | None) -> set[str]:
        affected = set()
        before = self._assignment_env.pop(assignment_id, None)
        if before is not None:
            affected.add(before)
        if assignment is not None:
            self._assignment_env[assignment_id] = assignment.environment_id
            affected.add(assignment.environment_id)
        return affected

    def _rebuild_env(self, env_id: str) -> None:
        self.envs_rebuilt += 1
        env = self.view.env(env_id)
        self._index_env(env_id, env)
        routes = build_env_routes(self.view, env, self.domain, self._node_hosts) if env is not None else None
        old = self._routes.get(env_id)
        if routes == old:
            return
        self._content = None
        at = bisect.bisect_left(self._order, env_id)
        if routes is None:
            del self._routes[env_id]
            for sequence in (self._order, self._http_parts, self._l4_parts, self._internal_parts):
                del sequence[at]
        else:
            if old is None:
                self._order.insert(at, env_id)
                for parts in (self._http_parts, self._l4_parts, self._internal_parts):
                    parts.insert(at, b"")
            self._routes[env_id] = routes
            self._http_parts[at], self._l4_parts[at], self._internal_parts[at] = routes.http, routes.l4, routes.internal
        old_hosts = old.hostnames if old is not None else ()
        new_hosts = routes.hostnames if routes is not None else ()
        if old_hosts != new_hosts:
            self._forget_cert_hosts(old_hosts)
            self._remember_cert_hosts(new_hosts)

    def _index_env(self, env_id: str, env: pb.Environment | None) -> None:
        before = self._env_inputs.pop(env_id, None)
        if before is not None:
            self._envs_by_app[before[0]].discard(env_id)
            self._envs_by_project[before[1]].discard(env_id)
        if env is not None:
            self._env_inputs[env_id] = (env.app_id, env.project_id)
            self._envs_by_app[env.app_id].add(env_id)
            self._envs_by_project[env.project_id].add(env_id)

    def _remember_cert_hosts(self, hostnames: Iterable[str]) -> None:
        for host in hostnames:
            refs = self._host_refs.get(host, 0)
            self._host_refs[host] = refs + 1
            if not refs:
                bisect.insort(self._cert_hosts, host)
                self._cert_hosts_bytes = None

    def _forget_cert_hosts(self, hostnames: Iterable[str]) -> None:
        for host in hostnames:
            refs = self._host_refs[host] - 1
            if refs:
                self._host_refs[host] = refs
            else:
                del self._host_refs[host]
                del self._cert_hosts[bisect.bisect_left(self._cert_hosts, host)]
                self._cert_hosts_bytes = None
