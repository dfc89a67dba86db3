"""Who is calling: bearer tokens mapped to users, in kube-apiserver's static token file format.

Each line of the token file is ``token,user,uid,"group1,group2"`` (``--token-auth-file``). A
request without a token is the configured default user (``system:anonymous`` unless told
otherwise); an unknown token is 401. There is no authorization: every authenticated user may do
everything, and the identity only matters to admission (``userInfo``) -- which is where scrubgate
looks at it.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

AUTHENTICATED = "system:authenticated"


@dataclass(frozen=True)
class UserInfo:
    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()

    def to_json(self) -> dict:
        out: dict = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            out["uid"] = self.uid
        return out


ANONYMOUS = UserInfo("system:anonymous", groups=("system:unauthenticated",))
ADMIN = UserInfo("kubernetes-admin", groups=("system:masters", AUTHENTICATED))


def service_account(namespace: str, name: str) -> UserInfo:
    return UserInfo(
        f"system:serviceaccount:{namespace}:{name}",
        uid=f"sa-{namespace}-{name}",
        groups=("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


def node_user(node: str) -> UserInfo:
    return UserInfo(f"system:node:{node}", groups=("system:nodes", AUTHENTICATED))


# The identities of the simulated control-plane components, as kube-controller-manager and
# kube-scheduler present themselves.
SCHEDULER = UserInfo("system:kube-scheduler", groups=(AUTHENTICATED,))
GARBAGE_COLLECTOR = service_account("kube-system", "generic-garbage-collector")
NAMESPACE_CONTROLLER = service_account("kube-system", "namespace-controller")
CLAIM_CONTROLLER = service_account("kube-system", "resource-claim-controller")


class Authenticator:
    def __init__(self, tokens: Mapping[str, UserInfo] | None = None, default_user: UserInfo = ANONYMOUS) -> None:
        self.tokens = dict(tokens or {})
        self.default_user = default_user

    def authenticate(self, authorization: str | None) -> UserInfo | None:
        """The user behind an ``Authorization`` header; None means 401."""
        if not authorization:
            return self.default_user
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.tokens.get(token.strip())


def parse_token_file(text: str) -> dict[str, UserInfo]:
    tokens: dict[str, UserInfo] = {}
    for row_no, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row or row[0].startswith("#"):
            continue
        if len(row) < 3:
            raise ValueError(f'token file line {row_no}: want token,user,uid[,"group1,group2"], got {row!r}')
        groups = tuple(g.strip() for g in row[3].split(",") if g.strip()) if len(row) > 3 else ()
        if AUTHENTICATED not in groups:
            groups = (*groups, AUTHENTICATED)
        tokens[row[0].strip()] = UserInfo(row[1].strip(), row[2].strip(), groups)
    return tokens


def load_token_file(path: Path) -> dict[str, UserInfo]:
    return parse_token_file(path.read_text(encoding="utf-8"))
