"""Keys of the ``zattera-state`` bucket (docs/wire-contract.md) and the protobuf type stored under each kind.

A key is ``<kind>.<id>``, except the per-node kinds ``assignment.<node>.<id>`` and
``observed.<node>.<assignment_id>``. This module is the only place that knows the layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared.errors import ZatteraError

NODE = "node"
PROJECT = "project"
APP = "app"
ENV = "env"
DOMAIN = "domain"
RELEASE = "release"
DEPLOYMENT = "deployment"
BUILD = "build"
ASSIGNMENT = "assignment"
OBSERVED = "observed"
VOLUME = "volume"
SNAPSHOT = "snapshot"
IMAGE = "image"
VIP = "vip"
LEASE = "lease"
SECRET = "secret"
SECRETS_KEY = "secretskey"
JOB = "job"
BACKUP_SCHEDULE = "backupschedule"
BACKUP_RUN = "backuprun"
NOTIFY_CHANNEL = "notifychannel"
NOTIFY_STATUS = "notifystatus"

CERT = "cert"
ACME_ACCOUNT = "acmeaccount"
LOG_DRAIN = "logdrain"
LOG_DRAIN_STATUS = "logdrainstatus"

MESSAGE_TYPES: dict[str, type[Message]] = {
    NODE: pb.Node,
    PROJECT: pb.Project,
    APP: pb.App,
    ENV: pb.Environment,
    DOMAIN: pb.Domain,
    RELEASE: pb.Release,
    DEPLOYMENT: pb.Deployment,
    BUILD: pb.Build,
    ASSIGNMENT: pb.Assignment,
    OBSERVED: pb.AssignmentObserved,
    VOLUME: pb.Volume,
    SNAPSHOT: pb.VolumeSnapshot,
    IMAGE: pb.Image,
    VIP: pb.ServiceVIP,
    LEASE: pb.Lease,
    SECRET: pb.SealedSecret,
    SECRETS_KEY: pb.SecretsKey,
    JOB: pb.Job,
    BACKUP_SCHEDULE: pb.BackupSchedule,
    BACKUP_RUN: pb.BackupRun,
    NOTIFY_CHANNEL: pb.NotifyChannel,
    NOTIFY_STATUS: pb.NotifyStatus,
    CERT: pb.Certificate,
    ACME_ACCOUNT: pb.AcmeAccount,
    LOG_DRAIN: pb.LogDrain,
    LOG_DRAIN_STATUS: pb.LogDrainStatus,
}

PER_NODE_KINDS = frozenset({ASSIGNMENT, OBSERVED})
ALL_KINDS = frozenset(MESSAGE_TYPES)


@dataclass(frozen=True, slots=True)
class Key:
    kind: str
    id: str
    node_id: str = ""

    def __str__(self) -> str:
        if self.kind in PER_NODE_KINDS:
            return f"{self.kind}.{self.node_id}.{self.id}"
        return f"{self.kind}.{self.id}"


class BadKey(ZatteraError, ValueError):
    """A key that is no subject tail (an empty token, white space, a control character, a wildcard)."""


NOT_IN_A_SUBJECT = re.compile(r"[\s*>\x00-\x1f\x7f]")
"""What a key cannot hold, as the tail of a NATS subject: whitespace and control characters (they split or
end the protocol line, so the write would land under another key or not at all) and the wildcards."""


def parse(key: str) -> Key:
    if bad := NOT_IN_A_SUBJECT.search(key):
        raise BadKey(f"key {key!r} holds {bad.group()!r}, which no NATS subject may")
    kind, _, rest = key.partition(".")
    if kind not in MESSAGE_TYPES or not rest:
        raise BadKey(f"unknown key {key!r}")
    if kind in PER_NODE_KINDS:
        node_id, _, ident = rest.partition(".")
        if not node_id or not ident or "." in ident:
            raise BadKey(f"malformed per-node key {key!r}")
        return Key(kind, ident, node_id)
    if "." in rest:
        raise BadKey(f"malformed key {key!r}")
    return Key(kind, rest)


def node(node_id: str) -> str:
    return f"{NODE}.{node_id}"


def project(project_id: str) -> str:
    return f"{PROJECT}.{project_id}"


def app(app_id: str) -> str:
    return f"{APP}.{app_id}"


def env(env_id: str) -> str:
    return f"{ENV}.{env_id}"


def domain(domain_id: str) -> str:
    return f"{DOMAIN}.{domain_id}"


def release(release_id: str) -> str:
    return f"{RELEASE}.{release_id}"


def deployment(deployment_id: str) -> str:
    return f"{DEPLOYMENT}.{deployment_id}"


def build(build_id: str) -> str:
    return f"{BUILD}.{build_id}"


def assignment(node_id: str, assignment_id: str) -> str:
    return f"{ASSIGNMENT}.{node_id}.{assignment_id}"


def observed(node_id: str, assignment_id: str) -> str:
    return f"{OBSERVED}.{node_id}.{assignment_id}"


def volume(volume_id: str) -> str:
    return f"{VOLUME}.{volume_id}"


def snapshot(snapshot_id: str) -> str:
    return f"{SNAPSHOT}.{snapshot_id}"


def image(image_id: str) -> str:
    return f"{IMAGE}.{image_id}"


def vip(env_id: str) -> str:
    return f"{VIP}.{env_id}"


def lease(loop: str) -> str:
    return f"{LEASE}.{loop}"


def secret(secret_id: str) -> str:
    return f"{SECRET}.{secret_id}"


def secrets_key(key_name: str) -> str:
    return f"{SECRETS_KEY}.{key_name}"


def job(job_id: str) -> str:
    return f"{JOB}.{job_id}"


def backup_schedule(name: str) -> str:
    return f"{BACKUP_SCHEDULE}.{name}"


def backup_run(name: str) -> str:
    return f"{BACKUP_RUN}.{name}"


def notify_channel(name: str) -> str:
    return f"{NOTIFY_CHANNEL}.{name}"


def notify_status(name: str) -> str:
    return f"{NOTIFY_STATUS}.{name}"


def cert_id(hostname: str) -> str:
    """A hostname as a key token (a hostname holds no '_', a key token no '.')."""
    return hostname.replace(".", "_")


def cert(hostname: str) -> str:
    return f"{CERT}.{cert_id(hostname)}"


def acme_account(name: str) -> str:
    return f"{ACME_ACCOUNT}.{name}"


def key_of(msg: Message) -> str:
    """The key a message is stored under, from its own fields (meta.id, node_id, ...)."""
    if isinstance(msg, pb.Assignment):
        return assignment(msg.node_id, msg.meta.id)
    if isinstance(msg, pb.ServiceVIP):
        return vip(msg.environment_id)
    for kind, cls in MESSAGE_TYPES.items():
        if isinstance(msg, cls) and kind not in (OBSERVED, LEASE, VIP):
            return f"{kind}.{msg.meta.id}"  # type: ignore[attr-defined]
    raise BadKey(f"no key rule for {type(msg).__name__}")


def names_another_key(msg: Message, key: str) -> str:
    """The key ``msg``'s own fields name when it is not ``key`` (a value stored under the wrong key: every
    reader would act on the id inside it), else ''. Kinds without a rule (observed, lease) name none."""
    try:
        own = key_of(msg)
    except BadKey:
        return ""
    return own if own != key else ""


def encode(msg: Message) -> bytes:
    """Deterministic bytes; an Assignment is stored without its observed part (agents own that)."""
    if isinstance(msg, pb.Assignment) and msg.HasField("observed"):
        desired = pb.Assignment()
        desired.CopyFrom(msg)
        desired.ClearField("observed")
        msg = desired
    return msg.SerializeToString(deterministic=True)


def decode(kind: str, data: bytes) -> Message:
    msg = MESSAGE_TYPES[kind]()
    msg.ParseFromString(data)
    return msg


def log_drain(name: str) -> str:
    return f"{LOG_DRAIN}.{name}"


def log_drain_status(name: str) -> str:
    return f"{LOG_DRAIN_STATUS}.{name}"
