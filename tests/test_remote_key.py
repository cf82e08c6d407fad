"""Remote engines' connection key (issue 29, defect 8): without ``MEGATRON_RL_ENGINE_KEY`` the
key was derived from the hub's public ``host:port``, so anyone who could reach rank 0 could
authenticate and send it a pickle. A key is now required unless the hub is on loopback, on
both sides (rank 0's ``EngineHub``, each node's engine host); no test sends anything to a
non-loopback address (192.0.2.1 is TEST-NET-1: bind fails, nothing is sent)."""

from __future__ import annotations

import hashlib
import socket
import types
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from megatron_rl.rollout import engine_host, remote
from megatron_rl.rollout.remote import KEY_VAR, EngineHub, engine_key, is_loopback

PUBLIC = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never routed


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv(KEY_VAR, raising=False)


@pytest.mark.parametrize(
    "host, loop",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("LocalHost", True),
        ("::1", True),
        ("[::1]", True),
        ("10.0.0.5", False),
        ("192.168.1.2", False),
        (PUBLIC, False),
        ("0.0.0.0", False),
        ("::", False),
        ("node-0", False),
        ("localhost.example.com", False),
    ],
)
def test_is_loopback_only_for_this_machines_addresses(host, loop):
    assert is_loopback(host) is loop


@pytest.mark.parametrize("host", [PUBLIC, "10.0.0.5", "node-0", "0.0.0.0"])
def test_no_key_on_a_non_loopback_hub_is_refused_with_how_to_set_it(no_key, host):
    with pytest.raises(ValueError) as err:
        engine_key(host, 29501)
    text = str(err.value)
    assert KEY_VAR in text and "secrets.token_hex(32)" in text and "every node" in text
    assert f"{host}:29501" in text and "rollout.sync_address" in text


def test_loopback_hub_keeps_the_derived_key(no_key):
    derived = hashlib.sha256(b"megatron_rl-engines:127.0.0.1:29501").digest()
    assert engine_key("127.0.0.1", 29501) == derived
    assert engine_key("127.0.0.1", 29502) != derived


def test_a_set_key_is_used_on_any_address(monkeypatch):
    monkeypatch.setenv(KEY_VAR, "  s3cret  ")
    want = hashlib.sha256(b"s3cret").digest()
    assert engine_key(PUBLIC, 29501) == want == engine_key("127.0.0.1", 1)


def test_blank_key_counts_as_unset(monkeypatch):
    monkeypatch.setenv(KEY_VAR, "   ")
    with pytest.raises(ValueError, match=KEY_VAR):
        engine_key(PUBLIC, 29501)


def test_hub_side_refuses_before_listening(no_key, monkeypatch):
    bound = []
    monkeypatch.setattr(remote.socket, "socket", lambda *a, **k: bound.append(a) or socket.socket(*a, **k))
    with pytest.raises(ValueError, match=KEY_VAR):
        EngineHub(PUBLIC, 29501)
    assert not bound  # no socket was even made


def test_engine_host_side_refuses_before_starting_a_keeper(no_key, monkeypatch):
    started = []

    class Keeper:  # stands in for EngineKeeper: a real one would connect to the address
        def __init__(self, spec, *rest):
            started.append(spec.index)

        def run(self):
            pass

    monkeypatch.setattr(engine_host, "EngineKeeper", Keeper)
    spec = types.SimpleNamespace(index=3, node=1)
    with pytest.raises(ValueError, match=KEY_VAR):
        engine_host.serve([spec], (PUBLIC, 29501), timeout_s=1.0)
    assert not started
    assert engine_host.serve([spec], ("127.0.0.1", 29501), timeout_s=1.0) == 0  # loopback: served as before
    assert started == [3]


def test_loopback_hub_with_a_key_admits_only_that_key(monkeypatch):
    monkeypatch.setenv(KEY_VAR, "right")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hub = EngineHub("127.0.0.1", port)
    try:
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", port), authkey=hashlib.sha256(b"megatron_rl-engines:127.0.0.1:%d" % port).digest())
        Client(("127.0.0.1", port), authkey=engine_key("127.0.0.1", port)).close()
    finally:
        hub.close()
