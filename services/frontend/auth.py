"""API keys on the public APIs: the one check the gRPC and HTTP APIs share.

Clients send ``authorization: Bearer <key>`` (gRPC metadata or the HTTP
header). With no key configured every call is open, as before keys existed.
With keys (vLLM's ``--api-key``):

- every call of the public API needs one of ``api_keys`` or ``admin_api_keys``;
- the calls that show the whole cluster's activity (GetStats, the dashboard's
  stats, ``/metrics``) need one of ``admin_api_keys``; with none configured
  they are closed to everyone;
- each key's requests get a prefix-cache salt derived from the key, unless
  the request sets its own, so tenants never share prefix-cache hits (a hit
  reveals that someone sent the same prefix).

Failures are ``AuthError``: UNAUTHENTICATED / 401 for a missing or unknown
key, PERMISSION_DENIED / 403 for a valid key that is not an admin key.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

_BEARER = "bearer "
# Keeps the salt of a key apart from any hash of the same text used elsewhere.
_SALT_DOMAIN = b"kvmesh api key cache salt\x00"


class Role(enum.Enum):
    USER = "user"  # generation, tokenization, model info
    ADMIN = "admin"  # what shows every tenant's activity


class AuthError(Exception):
    """A call refused by the key check; ``forbidden`` tells 403 apart from 401."""

    def __init__(self, message: str, *, forbidden: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.forbidden = forbidden


def parse_api_keys(values: Iterable[str] | None) -> tuple[str, ...]:
    """Keys from repeated and comma-separated values (``--api-key a,b --api-key c``)."""
    keys = (key.strip() for value in values or () for key in value.split(","))
    return tuple(dict.fromkeys(key for key in keys if key))


@dataclass(frozen=True, slots=True)
class ApiKeyAuth:
    """The configured keys; see the module docstring for the rules."""

    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_api_keys)

    def check(self, authorization: str | None, role: Role) -> str | None:
        """The key a call authenticated with (None while keys are off).

        ``authorization`` is the header's value, ``Bearer <key>``. Raises AuthError.
        """
        if not self.enabled:
            return None
        key = _bearer_key(authorization)
        is_admin = _matches(key, self.admin_api_keys)
        if not is_admin and not _matches(key, self.api_keys):
            raise AuthError("invalid API key: send 'Authorization: Bearer <key>' "
                            "with a key this server was started with")
        if role is Role.ADMIN and not is_admin:
            raise AuthError("this call shows every tenant's activity and needs an admin "
                            "API key (--admin-api-key)", forbidden=True)
        return key

    def cache_salt(self, key: str | None, requested: str | None) -> str | None:
        """The request's cache salt: its own when it sets one, else its key's."""
        if requested is not None or key is None:
            return requested
        return hashlib.sha256(_SALT_DOMAIN + key.encode()).hexdigest()


def _bearer_key(authorization: str | None) -> str:
    if not authorization or not authorization[:len(_BEARER)].lower() == _BEARER:
        raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
    return authorization[len(_BEARER):].strip()


def _matches(key: str, keys: tuple[str, ...]) -> bool:
    # Compares with every key in constant time, so timing tells nothing about
    # how much of a key was right or which key came close.
    found = False
    for candidate in keys:
        found |= hmac.compare_digest(key.encode(), candidate.encode())
    return found
