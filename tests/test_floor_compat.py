"""What the workbook does differently on its oldest supported torch (2.7, ``make test-floor``), checked here on
the installed torch with its version string stood in for (issue #24.4)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from helpers.chapters.ch07 import torchrun
from helpers.core import device


@pytest.mark.parametrize(
    "version,major,minor,expected",
    [
        ("2.7.0+cu126", 2, 7, True),
        ("2.7.0", 2, 8, False),
        ("2.8.0a0+git1234", 2, 8, True),
        ("2.14.1+cu130", 2, 8, True),
        ("2.14.1", 2, 15, False),
        ("3.0.0", 2, 99, True),
    ],
)
def test_torch_at_least(monkeypatch: pytest.MonkeyPatch, version: str, major: int, minor: int, expected: bool) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert device.torch_at_least(major, minor) is expected


class _StoreStandIn:
    """Records what the loopback store hands to c10d's TCPStore (no socket is opened by this class)."""

    seen: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:  # a keyword left out takes c10d's default
        type(self).seen.append(kwargs)


@pytest.mark.parametrize("version,libuv", [("2.7.0+cu126", False), ("2.8.0", True), ("2.14.1+cu130", True)])
def test_loopback_store_uses_libuv_only_where_it_takes_a_listen_fd(
    monkeypatch: pytest.MonkeyPatch, version: str, libuv: bool
) -> None:
    """torch < 2.8's libuv TCPStore refuses a listening socket (NotImplementedError; pytorch PR #150215 added it):
    chapter 07's torchrun died at rendezvous on torch 2.7. There the store takes the legacy backend instead."""
    monkeypatch.setattr(torch, "__version__", version)
    _StoreStandIn.seen = []
    store = torchrun._loopback_tcpstore(_StoreStandIn)
    store("127.0.0.1", 0, 2, True, None)  # the server: given a socket bound to 127.0.0.1
    store("127.0.0.1", 29500, 2, False, None)  # a client: no listen fd, libuv as asked
    server, client = _StoreStandIn.seen
    assert server["master_listen_fd"] is not None and server["use_libuv"] is libuv
    assert client.get("master_listen_fd") is None and client.get("use_libuv", True) is True  # c10d's default: libuv
    os.close(server["master_listen_fd"])  # the stand-in does not take the socket over, so close it here
