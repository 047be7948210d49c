"""RBAC for the fake API server, decided as kube-apiserver's RBAC authorizer decides it.

`Rbac.from_objects` takes rbac.authorization.k8s.io/v1 ClusterRoles, ClusterRoleBindings, Roles and
RoleBindings (e.g. examples/kubernetes/rbac.yaml as written). A request is allowed when a rule of
a role bound to its user (a User subject, or a ServiceAccount subject as
`system:serviceaccount:<namespace>:<name>`, or one of the user's groups) matches its API group,
resource and verb (`*` matching any), as pkg/registry/rbac/validation's RuleAllows does. The fake
server serves cluster-wide lists and watches only, so only ClusterRoleBindings grant them (a
RoleBinding grants in its namespace, which a cluster-scope request is not); a rule naming
`resourceNames` never allows a list or watch (as the real authorizer, without a field selector on
the name). A denied request gets the real server's 403 Status and message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    names: frozenset[str]

    def allows(self, group: str, resource: str, verb: str) -> bool:
        return (_has(self.groups, group) and _has(self.resources, resource) and _has(self.verbs, verb)
                and not (self.names and verb in ("list", "watch")))


def _has(values: frozenset[str], value: str) -> bool:
    return "*" in values or value in values


class Rbac:
    """Cluster-scope RBAC: the rules of every ClusterRole bound cluster-wide to each subject."""

    def __init__(self, rules_by_subject: dict[str, list[Rule]]) -> None:
        self.rules_by_subject = rules_by_subject

    @classmethod
    def from_objects(cls, objects: Iterable[Obj]) -> Rbac:
        objs = list(objects)
        roles = {o["metadata"]["name"]: [_rule(r) for r in o.get("rules") or []]
                 for o in objs if o.get("kind") == "ClusterRole"}
        out: dict[str, list[Rule]] = {}
        for b in objs:
            if b.get("kind") != "ClusterRoleBinding" or b["roleRef"]["kind"] != "ClusterRole":
                continue
            for subject in b.get("subjects") or []:
                out.setdefault(_subject(subject), []).extend(roles.get(b["roleRef"]["name"], []))
        return cls(out)

    def denied(self, user: str, groups: Iterable[str], group: str, resource: str, verb: str) -> str | None:
        """None when allowed, else the 403 message the real server sends."""
        for who in (f"user:{user}", *(f"group:{g}" for g in groups)):
            if any(r.allows(group, resource, verb) for r in self.rules_by_subject.get(who, [])):
                return None
        what = f"{resource}.{group}" if group else resource
        return (f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API group '
                f'"{group}" at the cluster scope')


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def service_account_groups(namespace: str) -> tuple[str, ...]:
    """The groups the token authenticator puts a ServiceAccount in."""
    return ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated")


def _rule(raw: Obj) -> Rule:
    return Rule(frozenset(raw.get("apiGroups") or []), frozenset(raw.get("resources") or []),
                frozenset(raw.get("verbs") or []), frozenset(raw.get("resourceNames") or []))


def _subject(raw: Obj) -> str:
    if raw["kind"] == "ServiceAccount":
        return f"user:{service_account_user(raw['namespace'], raw['name'])}"
    return f"{'group' if raw['kind'] == 'Group' else 'user'}:{raw['name']}"
