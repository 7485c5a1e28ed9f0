"""The secrets service: the only holder of the cluster secrets key's private half.

* **Key.** On start it loads the keyring file (0600; ``ZATTERA_SECRETS_KEY`` seeds it when there is no
  file). With neither, and no key published yet, it makes the cluster's first key (so ``zattera up`` gets one
  once); a published key this replica does not hold is never replaced: it refuses requests instead.
  It publishes the current key's public half as ``secretskey.cluster``.
* **Open.** ``zattera.secrets.<node>.open`` (queue group): the secrets of ONE assignment, answered only
  when that assignment is on that node, desired RUN, and the request's node key is the one in the node's
  record; the values are sealed to that key. Under ``--secure`` only that node's credential may publish on
  that subject (shared/security/permissions.py).
* **Rotate.** ``zattera.secrets.rotate``: a new key first joins the keyring file (so every secret stays
  readable), is published (a CLI sealing with the old public key is refused by the fence on
  ``secretskey.cluster`` and seals again), every sealed secret is re-sealed under it, then the old key is
  dropped from the file. A replica that restarts with more than one key in its file finishes the job.

Nothing here logs, traces or answers a value: errors name secrets, versions, assignments and nodes only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import Message
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.certs import ACCOUNT_OPEN_SUBJECT, KEYS_OPEN_SUBJECT
from shared.connection import Connection
from shared.events import WARNING, EventPublisher, make_event
from shared.records import new_meta
from shared.secrets import (
    CLUSTER_KEY,
    ROTATE_SUBJECT,
    SECRETS_QUEUE,
    KeyMaterialError,
    Keyring,
    create_keyring,
    key_id,
    load_keyring,
    open_subject,
    private_key_from_hex,
    public_bytes,
    save_keyring,
    seal,
    unseal,
)
from shared.security.callers import caller
from shared.state.feed import StateView
from shared.state.reader import StateReader
from shared.subjects import is_direct_request
from shared.tasks import cancel_and_wait, serve_until_cancelled
from shared.telemetry import span
from shared.txn import CommitUnknown, Conflict, Writer

from . import certkeys

log = logging.getLogger(__name__)

NO_KEY = "the secrets service holds no cluster secrets key (see docs/secrets.md)"
RESEAL_ROUNDS = 20


@dataclass(frozen=True)
class SealedField:
    """Where a record holds a value sealed to the cluster key: the sealed bytes and the key id beside them,
    in the record itself or in one of its sub-messages (``within``)."""

    field: str
    key_field: str = "key_id"
    within: str = ""

    def holder(self, record: Message) -> Any:
        return getattr(record, self.within) if self.within else record


SEALED_FIELDS = {
    K.SECRET: SealedField("ciphertext"),
    K.CERT: SealedField("sealed_key"),
    K.ACME_ACCOUNT: SealedField("sealed_key"),
    K.BACKUP_SCHEDULE: SealedField("sealed_credentials"),
    K.VOLUME: SealedField("offsite_sealed_settings", "offsite_key_id", within="snapshot_policy"),
    K.NOTIFY_CHANNEL: SealedField("sealed"),
    K.LOG_DRAIN: SealedField("sealed"),
    K.GIT_HOOK: SealedField("sealed"),
}
"""Each kind holding a value sealed to the cluster key, and where (re-sealed on rotation)."""


def authorize(view: StateReader, node_id: str, request: cpb.OpenSecretsRequest) -> tuple[pb.Release, pb.Node] | str:
    """The release whose secrets ``node_id`` may open for ``request``, with the node; else why not."""
    if request.node_id != node_id:
        return f"the request names node {request.node_id!r} but came on node {node_id}'s subject"
    node = view.node(node_id)
    if node is None:
        return f"node {node_id} is not registered"
    if not node.secrets_public_key:
        return f"node {node_id} has registered no secrets key"
    if request.node_public_key != node.secrets_public_key:
        return f"node {node_id}'s key is not the one registered (re-registration in progress?)"
    a = view.assignment(request.assignment_id)
    if a is None or a.node_id != node_id:
        return f"assignment {request.assignment_id} is not placed on node {node_id}"
    if a.desired != pb.ASSIGNMENT_DESIRED_RUN:
        return f"assignment {request.assignment_id} is not desired running"
    release = view.release(a.release_id)
    if release is None:
        return f"release {a.release_id} of assignment {request.assignment_id} not found"
    return release, node


@dataclass(eq=False)
class SecretsService:
    conn: Connection
    view: StateView
    writer: Writer
    _: KW_ONLY
    keyring_path: Path
    seed_key: str = ""
    """The cluster key's private half (hex) that seeds the keyring file when there is none."""
    open_wait: float = 3.0
    """How long a request waits for the view to show its node key or assignment, seconds."""
    serving: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    """Set once the key is loaded (or found missing) and requests are answered."""
    _events: EventPublisher = field(init=False)
    _keyring: Keyring | None = field(default=None, init=False)
    _rotating: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _handling: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self._events = EventPublisher(self.conn)

    @property
    def keyring(self) -> Keyring | None:
        return self._keyring

    # ------------------------------------------------------------------ key

    def _published(self) -> pb.SecretsKey | None:
        return self.view.get(K.SECRETS_KEY, CLUSTER_KEY)  # type: ignore[return-value]

    def load_key(self) -> None:
        """The keyring from the file, else from the seed, else a new one when the cluster has none yet."""
        keyring = load_keyring(self.keyring_path)
        if keyring is None and self.seed_key:
            keyring = create_keyring(self.keyring_path, Keyring([private_key_from_hex(self.seed_key)]))
        if keyring is None and self._published() is None:
            keyring = create_keyring(self.keyring_path, Keyring([PrivateKey.generate()]))
            log.info("cluster secrets key %s in %s", key_id(public_bytes(keyring.current)), self.keyring_path)
        self._keyring = keyring

    async def start(self) -> None:
        try:
            self.load_key()
        except KeyMaterialError as exc:
            log.error("secrets: %s", exc)
            return
        keyring = self._keyring
        published = self._published()
        if keyring is None:
            assert published is not None
            path = self.keyring_path
            log.error("secrets: the cluster key %s is published but %s does not hold it", published.key_id, path)
            return
        if published is not None and keyring.by_id(published.key_id) is None:
            log.error("secrets: %s does not hold the published cluster key %s", self.keyring_path, published.key_id)
            self._keyring = None
            return
        if not await self._publish(keyring.current):
            self._keyring = None
            return
        if len(keyring.keys) > 1:
            log.info("secrets: finishing an interrupted key rotation")
            await self._finish_rotation()

    async def _publish(self, key: PrivateKey) -> bool:
        """Publish ``key`` as the cluster key, replacing only a key of our own keyring (a rotation); False when
        another replica published a key this one does not hold (e.g. both started on a fresh cluster)."""
        public = public_bytes(key)
        ident = key_id(public)
        for _ in range(RESEAL_ROUNDS):
            current = self._published()
            if current is not None and current.key_id == ident:
                return True
            keyring = self._keyring
            if current is not None and (keyring is None or keyring.by_id(current.key_id) is None):
                log.error("secrets: the published cluster key %s is not in %s", current.key_id, self.keyring_path)
                return False
            record = pb.SecretsKey(key_id=ident, public_key=public)
            new_meta(record.meta, time.time(), CLUSTER_KEY)
            try:
                await self.writer.commit(self.writer.txn("secrets-key").put(record))
            except (Conflict, CommitUnknown):
                await asyncio.sleep(0.05)
                continue
            log.info("secrets: published cluster key %s", ident)
            return True
        raise RuntimeError("could not publish the cluster secrets key: it kept changing")

    def _reload_if_unknown(self, ident: str) -> PrivateKey | None:
        """A key another replica's rotation added to the shared file."""
        keyring = self._keyring
        key = keyring.by_id(ident) if keyring else None
        if key is None:
            try:
                fresh = load_keyring(self.keyring_path)
            except KeyMaterialError:
                return None
            if fresh is not None:
                self._keyring = fresh
                key = fresh.by_id(ident)
        return key

    # ------------------------------------------------------------------ open

    def open_values(self, release: pb.Release) -> dict[str, str] | str:
        """Plaintexts of the secrets ``release`` references, or why they cannot be opened."""
        values: dict[str, str] = {}
        for name, ref in sorted(release.service.secrets.items()):
            record = self.view.get(K.SECRET, ref.secret_id)
            if not isinstance(record, pb.SealedSecret):
                return f"secret {name} version {ref.version} is gone"
            key = self._reload_if_unknown(record.key_id)
            if key is None:
                return f"secret {name} version {ref.version} is sealed to key {record.key_id}, which is not held"
            try:
                values[name] = unseal(key, record.ciphertext).decode()
            except (CryptoError, UnicodeDecodeError):
                return f"secret {name} version {ref.version} does not open with key {record.key_id}"
        return values

    async def answer_open(self, node_id: str, request: cpb.OpenSecretsRequest) -> cpb.OpenSecretsResponse:
        if self._keyring is None:
            return cpb.OpenSecretsResponse(error=NO_KEY)
        decision = await self._authorize_when_fresh(node_id, request)
        if isinstance(decision, str):
            log.warning("secrets: refused node %s assignment %s: %s", node_id, request.assignment_id, decision)
            refused = make_event(
                "secrets.refused",
                f"node {node_id} was refused the secrets of assignment {request.assignment_id}: {decision}",
                severity=WARNING,
                node_id=node_id,
                fields={"assignment_id": request.assignment_id},
            )
            await self._events.publish(refused)
            return cpb.OpenSecretsResponse(error=decision)
        release, node = decision
        values = self.open_values(release)
        if isinstance(values, str):
            log.warning("secrets: assignment %s: %s", request.assignment_id, values)
            return cpb.OpenSecretsResponse(error=values)
        payload = cpb.SecretValues(values=values).SerializeToString(deterministic=True)
        log.info(
            "secrets: sealed %d secret(s) of assignment %s to node %s", len(values), request.assignment_id, node_id
        )
        return cpb.OpenSecretsResponse(sealed=seal(node.secrets_public_key, payload))

    async def _authorize_when_fresh(
        self, node_id: str, request: cpb.OpenSecretsRequest
    ) -> tuple[pb.Release, pb.Node] | str:
        """A request can outrun this replica's view (a node that just re-registered, a fresh assignment):
        re-decide on every change for a short while before refusing."""
        feed = self.view.subscribe({K.NODE, K.ASSIGNMENT, K.RELEASE})
        try:
            deadline = time.monotonic() + self.open_wait
            while True:
                decision = authorize(self.view, node_id, request)
                remaining = deadline - time.monotonic()
                if not isinstance(decision, str) or remaining <= 0:
                    return decision
                await feed.wait(remaining)
        finally:
            feed.close()

    async def _on_open(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            return  # a reply steered here, not a request (SECURITY.md): nobody to answer
        node_id = msg.subject.split(".")[2]
        sender = caller(msg)
        if sender is not None and sender.name != node_id:
            # The permissions tie the subject to the node's credential; the server-set identity says so again.
            refused = cpb.OpenSecretsResponse(error=f"node {sender.name or '(unknown)'} may not open for {node_id}")
            await msg.respond(refused.SerializeToString())
            return
        try:
            request = cpb.OpenSecretsRequest.FromString(msg.data)
        except Exception:
            response = cpb.OpenSecretsResponse(error="malformed request")
        else:
            with span("secrets.open", node_id=node_id, assignment_id=request.assignment_id):
                response = await self.answer_open(node_id, request)
        await msg.respond(response.SerializeToString())

    # ------------------------------------------------------------------ certificate keys

    async def _on_open_cert_keys(self, msg: Msg) -> None:
        if is_direct_request(msg):
            with span("secrets.open_cert_keys"):
                limit = self.conn.nc.max_payload
                response = certkeys.answer_page(msg.data, self.view, self._key_for, limit)
            await msg.respond(response.SerializeToString())

    async def _on_open_account(self, msg: Msg) -> None:
        if is_direct_request(msg):
            with span("secrets.open_account"):
                response = certkeys.answer(msg.data, lambda: certkeys.account_bundle(self.view, self._key_for))
            await msg.respond(response.SerializeToString())

    def _key_for(self, ident: str) -> PrivateKey | None:
        return self._reload_if_unknown(ident) if self._keyring is not None else None

    # ------------------------------------------------------------------ rotate

    async def rotate(self) -> cpb.RotateSecretsKeyResponse:
        async with self._rotating:
            if self._keyring is None:
                return cpb.RotateSecretsKeyResponse(error=NO_KEY)
            keyring = self._reload_current()  # another replica sharing the file may have rotated meanwhile
            assert keyring is not None
            previous = key_id(public_bytes(keyring.current))
            fresh = PrivateKey.generate()
            keyring = Keyring([fresh, *keyring.keys])
            save_keyring(self.keyring_path, keyring)  # before anything is sealed to it
            self._keyring = keyring
            if not await self._publish(fresh):
                return cpb.RotateSecretsKeyResponse(error="the published cluster key is not this service's")
            resealed = await self._finish_rotation()
            new_id = key_id(public_bytes(fresh))
            log.info("secrets: rotated the cluster key %s -> %s (%d secret(s) re-sealed)", previous, new_id, resealed)
            return cpb.RotateSecretsKeyResponse(key_id=new_id, previous_key_id=previous, resealed=resealed)

    def _reload_current(self) -> Keyring | None:
        try:
            fresh = load_keyring(self.keyring_path)
        except KeyMaterialError:
            fresh = None
        if fresh is not None:
            self._keyring = fresh
        return self._keyring

    async def _finish_rotation(self) -> int:
        """Re-seal every secret under the current key, then keep only that key."""
        keyring = self._keyring
        assert keyring is not None
        resealed = await self._reseal_all(keyring)
        save_keyring(self.keyring_path, Keyring([keyring.current]))
        self._keyring = Keyring([keyring.current])
        return resealed

    async def _reseal_all(self, keyring: Keyring) -> int:
        current = keyring.current
        public = public_bytes(current)
        ident = key_id(public)
        done = 0
        for _ in range(RESEAL_ROUNDS):
            stale = list(self._stale(keyring, ident))
            if not stale:
                return done
            txns = []
            for record, key, where in stale:
                updated = type(record)()
                updated.CopyFrom(record)
                holder = where.holder(updated)
                setattr(holder, where.field, seal(public, unseal(key, getattr(holder, where.field))))
                setattr(holder, where.key_field, ident)
                txns.append(self.writer.txn("secrets-reseal").put(updated))
            results = await self.writer.commit_many(txns)
            done += sum(1 for r in results if r is None)
        raise RuntimeError("secrets kept changing while re-sealing; rotate again")

    def _stale(self, keyring: Keyring, ident: str) -> Iterable[tuple[Message, PrivateKey, SealedField]]:
        """Every sealed value (secrets, certificate keys, the ACME account key, backup and off-site snapshot
        targets' settings, notification channels) not sealed to ``ident``."""
        for kind, where in SEALED_FIELDS.items():
            for record in self.view.all(kind):
                holder = where.holder(record)
                sealed_to: str = getattr(holder, where.key_field)
                if sealed_to == ident or not getattr(holder, where.field):
                    continue
                key = keyring.by_id(sealed_to)
                if key is None:
                    log.error("secrets: %s is sealed to unknown key %s", K.key_of(record), sealed_to)
                    continue
                yield record, key, where

    async def _on_rotate(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            return
        with span("secrets.rotate"):
            try:
                response = await self.rotate()
            except Exception as exc:
                log.exception("secrets: rotation failed")
                response = cpb.RotateSecretsKeyResponse(error=f"rotation failed: {type(exc).__name__}: {exc}")
        await msg.respond(response.SerializeToString())

    # ------------------------------------------------------------------ service

    async def run(self) -> None:
        await self.start()
        nc = self.conn.nc
        if self._keyring is None:
            # Without the cluster key this replica could only answer "no key": it leaves the requests to the
            # replicas that hold it (start() said why; a server machine gets the key when it joins).
            log.error("secrets: not serving requests: this replica holds no usable cluster key")
            self.serving.set()
            await asyncio.Event().wait()
        subs = [
            await nc.subscribe(open_subject("*"), queue=SECRETS_QUEUE, cb=self._concurrently(self._on_open)),
            await nc.subscribe(ROTATE_SUBJECT, queue=SECRETS_QUEUE, cb=self._concurrently(self._on_rotate)),
            await nc.subscribe(KEYS_OPEN_SUBJECT, queue=SECRETS_QUEUE, cb=self._on_open_cert_keys),
            await nc.subscribe(ACCOUNT_OPEN_SUBJECT, queue=SECRETS_QUEUE, cb=self._on_open_account),
        ]
        try:
            await serve_until_cancelled(self.serving, subs)
        finally:
            await cancel_and_wait(*self._handling)

    def _concurrently(self, handler: Callable[[Msg], Coroutine[Any, Any, None]]) -> Callable[[Msg], Awaitable[None]]:
        """nats-py runs one subscription's callbacks one after the other: a request that waits for the view
        must not hold up the others."""

        async def spawn(msg: Msg) -> None:
            task = asyncio.create_task(handler(msg))
            self._handling.add(task)
            task.add_done_callback(self._handling.discard)

        return spawn
