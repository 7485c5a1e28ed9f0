"""Which account each role lives in, and what the role accounts import from ``ZATTERA`` (SECURITY.md).

Only ``ZATTERA`` has JetStream. ``AGENTS``, ``PROXIES`` and ``OPERATORS`` import, as *services*, exactly
the subjects their roles may publish (``{{name()}}`` becomes ``*`` at the account level; the user's scoped
template still narrows it to its own name), so a role's publish reaches a stream or a control service
while the *replies* the server sends for it — JetStream API answers, publish acks, pulled messages —
travel back through ``_R_`` mappings into the role account, where no stream listens: a reply subject
steered at ``$KV.…`` or another agent's request subject stores nothing and reaches no handler as a request.

What flows the other way: ``AGENTS`` exports the agents' request subjects (``zattera.agent.<node>.…``) to
``ZATTERA`` (control services) and ``OPERATORS`` (volume snapshot/restore); ``ZATTERA`` exports as *streams*
what operators and proxies subscribe to (events, build events and logs, route snapshots). No role account
receives consumer deliveries: operators pull the watch consumers control opens for them (shared/watches.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shared.security.permissions import (
    INBOX,
    JS,
    MEMBER_ADMIN_SUBJECTS,
    ROLE_PERMISSIONS,
    Role,
)
from shared.subjects import EVENTS_SUBJECT_PREFIX, STATE_PREFIX

RELAY_PREFIX = "zattera.relay."
"""Agents' and operators' state-bucket writes arrive in ``ZATTERA`` under this prefix (their import renames
them), where the relay (:mod:`shared.security.relay`) republishes them without the headers that could act
beyond the key: the state stream must accept rollups (``subject_delete_marker_ttl`` forces it), they may not."""

AGENT_REQUESTS = "zattera.agent.>"
"""Requests addressed to a node's agent: served in ``AGENTS``, asked from ``ZATTERA`` and ``OPERATORS``."""


class Account(StrEnum):
    ZATTERA = "zattera"
    AGENTS = "agents"
    PROXIES = "proxies"
    OPERATORS = "operators"
    MEMBERS = "members"


ROLE_ACCOUNT: dict[Role, Account] = {
    Role.CONTROL: Account.ZATTERA,
    Role.OPERATOR: Account.OPERATORS,
    Role.AGENT: Account.AGENTS,
    Role.BUILDER: Account.AGENTS,
    Role.PROXY: Account.PROXIES,
    Role.MEMBER: Account.MEMBERS,
}
ROLE_ACCOUNTS = (Account.AGENTS, Account.PROXIES, Account.OPERATORS, Account.MEMBERS)

STREAM_RESPONSES = (f"{JS}.CONSUMER.MSG.NEXT.", f"{JS}.DIRECT.GET.", AGENT_REQUESTS[:-1])
"""Exports whose one request gets many answers (a pull's messages, a batch direct get such as the CLI's
``multi_last`` snapshot read, a snapshot's progress)."""


def account_pattern(pattern: str) -> str:
    """A role template subject as an account-level subject: tokens naming the user become ``*``."""
    return ".".join("*" if "{{" in token else token for token in pattern.split("."))


def covers(general: str, specific: str) -> bool:
    """True when every subject matching ``specific`` also matches ``general``."""
    wide, narrow = general.split("."), specific.split(".")
    for index, token in enumerate(wide):
        if token == ">":
            return len(narrow) > index
        if index >= len(narrow) or narrow[index] == ">":
            return False
        if token not in ("*", narrow[index]):
            return False
    return len(wide) == len(narrow)


def minimal(patterns: list[str]) -> list[str]:
    """The patterns without those another one covers (overlapping imports would be ambiguous)."""
    unique = sorted(set(patterns))
    return [p for p in unique if not any(other != p and covers(other, p) for other in unique)]


def _roles(account: Account) -> list[Role]:
    return [role for role, home in ROLE_ACCOUNT.items() if home is account]


def _served_by_agents(subject: str) -> bool:
    return covers(AGENT_REQUESTS, subject)


def service_imports(account: Account) -> list[str]:
    """What the account's roles publish, as subjects served by ``ZATTERA``."""
    published = [account_pattern(p) for role in _roles(account) for p in ROLE_PERMISSIONS[role].pub_allow]
    return minimal([p for p in published if not _served_by_agents(p)])


def agent_request_imports(account: Account) -> list[str]:
    """The agents' request subjects this account's roles may publish (served by ``AGENTS``)."""
    published = [account_pattern(p) for role in _roles(account) for p in ROLE_PERMISSIONS[role].pub_allow]
    return minimal([p for p in published if _served_by_agents(p)])


def stream_imports(account: Account) -> list[str]:
    """What the account's roles subscribe to that is published in ``ZATTERA``."""
    subscribed = [account_pattern(p) for role in _roles(account) for p in ROLE_PERMISSIONS[role].sub_allow]
    own = {account_pattern(INBOX)}
    return minimal([p for p in subscribed if p not in own and not _served_by_agents(p)])


AUTHZ_PREFIX = "zattera.authz."
"""Members' reads arrive in ``ZATTERA`` under this prefix (their import renames them), where the authorising
path (:mod:`shared.security.authz`) answers them with what the caller's grants allow (docs/teams.md)."""
AUTHORISED_READS = (f"{JS}.DIRECT.GET.", f"{JS}.STREAM.INFO.", EVENTS_SUBJECT_PREFIX)


def response_type(subject: str) -> str:
    return "Stream" if subject.removeprefix(AUTHZ_PREFIX).startswith(STREAM_RESPONSES) else "Singleton"


def _admin_subject(subject: str) -> bool:
    return any(covers(pattern, subject) or pattern == subject for pattern in MEMBER_ADMIN_SUBJECTS)


def authorised(account: Account, subject: str) -> bool:
    """Members' reads, stream infos, the events they publish and the admins' cluster-wide subjects go through
    the authorising path."""
    return account is Account.MEMBERS and (subject.startswith(AUTHORISED_READS) or _admin_subject(subject))


def relayed(account: Account, subject: str) -> bool:
    """State-bucket writes of agents and operators go through the relay (no rollup, no batch of others')."""
    return account in (Account.AGENTS, Account.OPERATORS, Account.MEMBERS) and subject.startswith(STATE_PREFIX)


def exported_as(account: Account, subject: str) -> str:
    """The subject ``ZATTERA`` exports for an import of ``subject`` by ``account``."""
    if authorised(account, subject):
        return AUTHZ_PREFIX + subject
    return RELAY_PREFIX + subject if relayed(account, subject) else subject


def service_export(subject: str) -> dict[str, Any]:
    return {"name": subject, "subject": subject, "type": "service", "response_type": response_type(subject)}


def zattera_exports() -> list[dict[str, Any]]:
    services = minimal([exported_as(a, s) for a in ROLE_ACCOUNTS for s in service_imports(a)])
    streams = minimal([s for account in ROLE_ACCOUNTS for s in stream_imports(account)])
    return [service_export(s) for s in services] + [{"name": s, "subject": s, "type": "stream"} for s in streams]


def role_account_imports(account: Account, keys: dict[Account, str]) -> list[dict[str, Any]]:
    """The imports of a role account; ``keys`` are the accounts' public keys. Imports share the requester's
    identity (``Nats-Request-Info``, set by the server) so control handlers know who asks."""
    zattera = keys[Account.ZATTERA]
    imports: list[dict[str, Any]] = [
        {"name": s, "subject": exported_as(account, s), "account": zattera, "type": "service", "share": True}
        | ({"local_subject": s} if relayed(account, s) or authorised(account, s) else {})
        for s in service_imports(account)
    ]
    imports += [
        {"name": s, "subject": s, "account": keys[Account.AGENTS], "type": "service", "share": True}
        for s in agent_request_imports(account)
    ]
    imports += [{"name": s, "subject": s, "account": zattera, "type": "stream"} for s in stream_imports(account)]
    return imports


def zattera_imports(keys: dict[Account, str]) -> list[dict[str, Any]]:
    """Control services ask the agents (snapshots, restores, builds, prunes)."""
    return [{"name": AGENT_REQUESTS, "subject": AGENT_REQUESTS, "account": keys[Account.AGENTS], "type": "service"}]


def agents_exports() -> list[dict[str, Any]]:
    return [service_export(AGENT_REQUESTS)]
