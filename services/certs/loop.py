"""The certificate loop (lease ``certs``): one certificate per hostname that wants TLS, renewed in time.

Each pass reads the wanted hostnames (every ``Domain``'s, plus the route snapshot's ``cert_hosts`` when the
service follows routes: a snapshot that routes a new name wakes a pass at once, :class:`RoutedHosts`, so an
implicit ``<app>-<env>.localhost`` name gets its certificate as soon as it is routed, not at the next tick)
and the ``Certificate`` records, asks :func:`shared.certs.plan` what to do, and
commits: new hostnames get a PENDING record and stale records are deleted (500 a write) (a valid
certificate only once its name has been unwanted for ``FORGET_AFTER``); then each due order runs (only the
lease holder orders, so a name is never ordered twice at once across replicas) and its outcome — the new
chain and sealed key, or the CA's reason and the backoff — is one fenced write. Events
``certificate.issued``, ``certificate.renewed``, ``certificate.failed`` follow the write.

The proxies fetch the certificates again on ``zattera.certs.changed``: the loop publishes it after its own
writes, and on any pass that finds the servable records changed by another writer (``zattera restore``
puts a backup's certificates back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.certs.issuer import Account, AcmeIssuer, OrderFailed
from services.certs.localca import LocalCA, LocalCAFile
from shared import keys as K
from shared.acmechallenge import publish_answer, withdraw_answer
from shared.certclient import CertsUnavailable, open_bundle
from shared.certs import (
    ACCOUNT_NAME,
    ACCOUNT_OPEN_SUBJECT,
    CHANGED_SUBJECT,
    LOCAL_ISSUER,
    Issued,
    Order,
    after_failure,
    after_success,
    due_at,
    hostname_problem,
    is_local_host,
    pending_record,
    plan,
)
from shared.decision import Decision
from shared.events import INFO, WARNING, make_event
from shared.loop import LeaderLoop, LoopDeps
from shared.retry import Attempt, RetriesExhausted, commit_with_retry
from shared.secrets import CLUSTER_KEY, seal
from shared.settings import DEFAULTS
from shared.state.changes import ChangeFeed
from shared.txn import Conflict

log = logging.getLogger(__name__)


NO_DIRECTORY = "no ACME directory is configured (ZATTERA_CERTS_ACME_DIRECTORY, docs/certificates.md)"
NO_LOCAL_CA = "the local CA for *.localhost hosts is off (ZATTERA_CERTS_LOCAL_CA=false)"
NO_CLUSTER_KEY = "no cluster secrets key is published: run the secrets service (docs/secrets.md)"


RECORDS_PER_WRITE = 500
"""New PENDING records (or deleted ones) per fenced write, under the batch limit (``MAX_BATCH``, 1,000): a
pass that found 9,500 new hostnames failed whole, every time (issue 42 item 4's bench, 10,000 envs)."""


ROUTED_HOSTS = "routed-hosts"
"""The change a :class:`RoutedHosts` offers its feeds (not a state kind)."""


class RoutedHosts:
    """The hostnames the route snapshots want certificates for (``cert_hosts``); :meth:`update` with each new
    snapshot's names wakes the loops subscribed when they changed."""

    def __init__(self) -> None:
        self.current: frozenset[str] = frozenset()
        self._feeds: set[ChangeFeed] = set()

    def update(self, hostnames: Iterable[str]) -> None:
        names = frozenset(hostnames)
        if names != self.current:
            self.current = names
            for feed in list(self._feeds):
                feed._offer(ROUTED_HOSTS, "")

    def subscribe(self) -> ChangeFeed:
        feed = ChangeFeed(self, {ROUTED_HOSTS})
        self._feeds.add(feed)
        return feed


Served = tuple[str, str, bytes]
"""What a proxy is handed of a certificate record: its chain, and its key (the key id it is sealed to)."""


def served(cert: pb.Certificate) -> Served:
    return (cert.chain_pem, cert.key_id, bytes(cert.sealed_key))


class CertificateLoop(LeaderLoop):
    name = "certs"
    kinds = frozenset({K.DOMAIN, K.CERT, K.ACME_ACCOUNT, K.SECRETS_KEY})

    def __init__(
        self,
        deps: LoopDeps,
        *,
        acme: AcmeIssuer | None = None,
        local_ca: LocalCA | LocalCAFile | None = None,
        extra_hosts: Callable[[], Iterable[str]] = tuple,
        routed: RoutedHosts | None = None,
        tick: float = DEFAULTS.loop_tick,
    ) -> None:
        super().__init__(deps, tick=tick)
        self.acme = acme
        self.local_ca = local_ca
        self.routed = routed
        self.extra_hosts = extra_hosts if routed is None else (lambda: routed.current)
        self._account: Account | None = None
        self._next_due: float | None = None
        self._unwanted_since: dict[str, float] = {}
        self._announced: dict[str, Served] | None = None  # what the last notice told the proxies of

    def on_term_start(self) -> None:
        self._next_due = None
        self._unwanted_since = {}
        self._announced = None

    def extra_feeds(self) -> Sequence[ChangeFeed]:
        return [self.routed.subscribe()] if self.routed is not None else []

    def seconds_until_due(self) -> float | None:
        return None if self._next_due is None else self._next_due - self.clock.now()

    def wanted(self) -> set[str]:
        """Every routed hostname that can have a certificate (a name that is not a DNS name — e.g. an
        implicit ``<app>-<env>.<domain>`` with an underscore — is skipped: no CA issues for it, and its
        record key could collide with another name's)."""
        hosts = {d.hostname.lower() for d in self.view.domains()}
        hosts.update(h.lower() for h in self.extra_hosts())
        return {h for h in hosts if hostname_problem(h) is None}

    def event(self, kind: str, hostname: str, message: str, fields: dict[str, str], severity: str = INFO) -> pb.Event:
        """An event scoped to the environment a Domain routes ``hostname`` to (``zattera events --env``)."""
        domain = next((d for d in self.view.domains() if d.hostname.lower() == hostname), pb.Domain())
        return make_event(
            kind,
            message,
            severity=severity,
            clock=self.clock,
            project_id=domain.project_id,
            app_id=domain.app_id,
            environment_id=domain.environment_id,
            fields={"hostname": hostname, **fields},
        )

    def issuer_of(self, hostname: str) -> str:
        if is_local_host(hostname):
            return LOCAL_ISSUER
        return self.acme.directory_url if self.acme is not None else ""

    async def run_pass(self) -> None:
        certs = {c.hostname: c for c in self.view.all(K.CERT) if isinstance(c, pb.Certificate)}
        now, wanted = self.clock.now(), self.wanted()
        self._unwanted_since = {h: self._unwanted_since.get(h, now) for h in certs.keys() - wanted}
        await self._announce({h: served(c) for h, c in certs.items() if c.chain_pem})
        decided = plan(wanted, certs, now, self._unwanted_since)
        self._next_due = decided.next_due
        creates: list[Message] = [pending_record(host, self.issuer_of(host)) for host in decided.create]
        deletes = [K.cert(host) for host in decided.forget]
        records = (
            [  # each under the batch limit: 10,000 envs applied at once want 10,000 new records
                Decision("certs", creates=creates[i : i + RECORDS_PER_WRITE])
                for i in range(0, len(creates), RECORDS_PER_WRITE)
            ]
            + [
                Decision("certs", deletes=deletes[i : i + RECORDS_PER_WRITE])
                for i in range(0, len(deletes), RECORDS_PER_WRITE)
            ]
        )
        if not all(await self.commit_decisions(records)):
            return  # the change that refused one wakes the next pass
        if decided.forget:
            await self._announce({h: c for h, c in (self._announced or {}).items() if h not in decided.forget})
        for order in decided.orders:
            await self._order(order)

    async def _order(self, order: Order) -> None:
        current = self.view.get(K.CERT, K.cert_id(order.hostname))
        if not isinstance(current, pb.Certificate):
            return
        try:
            chain, key_pem = await self._obtain(order.hostname)
        except OrderFailed as exc:
            failed = after_failure(current, exc.reason, exc.retry_after, self.clock.now())
            event = self.event(
                "certificate.failed",
                order.hostname,
                f"certificate for {order.hostname} not obtained: {exc.reason}",
                {"failures": str(failed.failures)},
                WARNING,
            )
            await self.commit_decisions(
                [Decision(f"certs: failure of {order.hostname}", puts=[failed], events=[event])]
            )
            return
        await self._store(order, chain, key_pem, current.chain_pem)

    async def _store(self, order: Order, chain: str, key_pem: bytes, ordered_over: str) -> None:
        """Seal the new key to the published cluster key and store it, fenced on that key's record: a key
        rotated meanwhile (its re-sealing pass would miss this write) makes it seal again. A record that got
        another certificate meanwhile (``ordered_over``: the chain it held when ordered), not due, is kept:
        a restore put the backup's back."""
        issuer = self.issuer_of(order.hostname)
        assert self.writer is not None
        writer = self.writer

        def decide() -> Attempt[pb.Certificate | None]:
            current = self.view.get(K.CERT, K.cert_id(order.hostname))
            cluster_key = self.view.get(K.SECRETS_KEY, CLUSTER_KEY)
            if not isinstance(current, pb.Certificate) or not isinstance(cluster_key, pb.SecretsKey):
                return Attempt(None, None)  # no longer wanted (or the key is gone): the next pass decides again
            if current.chain_pem != ordered_over and due_at(current) > self.clock.now():
                return Attempt(None, None)
            sealed = Issued(chain, seal(cluster_key.public_key, key_pem), cluster_key.key_id)
            updated = after_success(current, sealed, issuer)
            return Attempt(writer.txn("certs").put(updated).put(cluster_key), updated)

        try:
            updated = await commit_with_retry(writer, decide, clock=self.clock, contended=order.hostname)
        except RetriesExhausted:
            log.warning("certs: %s kept changing while storing its certificate; ordering again later", order.hostname)
            return
        if updated is None:
            return
        kind = "certificate.renewed" if order.renewal else "certificate.issued"
        event = self.event(
            kind,
            order.hostname,
            f"certificate for {order.hostname} {kind.split('.')[1]}, valid until {updated.not_after.ToJsonString()}",
            {"issuer": issuer},
        )
        await self.events.publish(event)
        await self._announce({**(self._announced or {}), order.hostname: served(updated)})

    async def _announce(self, servable: dict[str, Served]) -> None:
        """Tell the proxies to fetch the certificates again when ``servable`` is not what they were last told
        of (every first pass of a term: a change may have come while no leader ran)."""
        if servable != self._announced:
            await self.conn.nc.publish(CHANGED_SUBJECT, b"")
            self._announced = servable

    async def _obtain(self, hostname: str) -> tuple[str, bytes]:
        """(chain PEM, private key PEM) from the local CA or the ACME directory; raises OrderFailed."""
        cluster_key = self.view.get(K.SECRETS_KEY, CLUSTER_KEY)
        if not isinstance(cluster_key, pb.SecretsKey):
            raise OrderFailed(NO_CLUSTER_KEY)
        if is_local_host(hostname):
            if self.local_ca is None:
                raise OrderFailed(NO_LOCAL_CA)
            return self.local_ca.issue(hostname, self.clock.now())
        if self.acme is None:
            raise OrderFailed(NO_DIRECTORY)
        account = await self._account_for(self.acme, cluster_key)
        conn = self.conn

        async def publish(token: str, validation: str) -> None:
            await publish_answer(conn, token, validation)

        async def withdraw(token: str) -> None:
            await withdraw_answer(conn, token)

        return await self.acme.issue(hostname, account, publish, withdraw)

    async def _account_for(self, acme: AcmeIssuer, cluster_key: pb.SecretsKey) -> Account:
        """The ACME account: held in memory, else opened by the secrets service, else registered and stored
        sealed (one fenced write)."""
        stored = self.view.get(K.ACME_ACCOUNT, ACCOUNT_NAME)
        usable = isinstance(stored, pb.AcmeAccount) and stored.directory_url == acme.directory_url
        if self._account is not None and usable:
            assert isinstance(stored, pb.AcmeAccount)
            if stored.uri == self._account.uri:
                return self._account
        if isinstance(stored, pb.AcmeAccount) and usable:
            try:
                bundle = await open_bundle(self.conn, ACCOUNT_OPEN_SUBJECT)
            except CertsUnavailable as exc:
                raise OrderFailed(f"the ACME account key could not be opened: {exc}") from None
            self._account = Account(bundle.account_key_pem.encode(), stored.uri)
            return self._account
        account = await acme.register()
        record = pb.AcmeAccount(
            directory_url=acme.directory_url,
            email=acme.email,
            uri=account.uri,
            sealed_key=seal(cluster_key.public_key, account.key_pem),
            key_id=cluster_key.key_id,
        )
        record.meta.id = ACCOUNT_NAME
        assert self.writer is not None
        try:  # fenced on the cluster key it is sealed to, like a certificate's key
            await self.writer.commit(self.writer.txn("certs").put(record).put(cluster_key))
        except Conflict:
            raise OrderFailed("the cluster secrets key changed while the ACME account was stored") from None
        self._account = account
        return account
