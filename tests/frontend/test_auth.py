"""API keys: the one check the gRPC and HTTP APIs share (services/frontend/auth.py)."""

from __future__ import annotations

import pytest

from services.frontend.auth import ApiKeyAuth, AuthError, Role, parse_api_keys


def test_keys_are_repeatable_and_comma_separated():
    assert parse_api_keys(["a,b", " c ", "a", ""]) == ("a", "b", "c")
    assert parse_api_keys(None) == ()


def test_no_keys_leave_everything_open():
    auth = ApiKeyAuth()
    assert not auth.enabled
    assert auth.check(None, Role.USER) is None
    assert auth.check("Bearer anything", Role.ADMIN) is None
    assert auth.cache_salt(None, None) is None
    assert auth.cache_salt(None, "mine") == "mine"


@pytest.mark.parametrize(("authorization", "message"), [
    (None, "missing API key"),
    ("", "missing API key"),
    ("Basic dXNlcjpwYXNz", "missing API key"),
    ("Bearer wrong", "invalid API key"),
    ("Bearer user-ke", "invalid API key"),
])
def test_a_missing_or_unknown_key_is_refused(authorization, message):
    auth = ApiKeyAuth(api_keys=("user-key",), admin_api_keys=("admin-key",))
    with pytest.raises(AuthError) as info:
        auth.check(authorization, Role.USER)
    assert message in info.value.message and not info.value.forbidden


def test_user_keys_serve_users_and_admin_keys_serve_both():
    auth = ApiKeyAuth(api_keys=("user-key",), admin_api_keys=("admin-key",))
    assert auth.check("Bearer user-key", Role.USER) == "user-key"
    assert auth.check("bearer admin-key", Role.USER) == "admin-key"
    assert auth.check("Bearer admin-key", Role.ADMIN) == "admin-key"
    with pytest.raises(AuthError) as info:
        auth.check("Bearer user-key", Role.ADMIN)
    assert info.value.forbidden and "--admin-api-key" in info.value.message


def test_with_user_keys_only_admin_calls_are_closed():
    auth = ApiKeyAuth(api_keys=("user-key",))
    with pytest.raises(AuthError):
        auth.check("Bearer user-key", Role.ADMIN)


def test_each_key_gets_its_own_cache_salt_unless_the_request_sets_one():
    auth = ApiKeyAuth(api_keys=("a", "b"))
    salt_a, salt_b = auth.cache_salt("a", None), auth.cache_salt("b", None)
    assert salt_a != salt_b and len(salt_a) == 64
    assert salt_a == ApiKeyAuth(api_keys=("a",)).cache_salt("a", None)  # stable across restarts
    assert "a" not in (salt_a[:1], salt_a)  # the key itself never travels
    assert auth.cache_salt("a", "shared") == "shared"
