"""Loopback addresses: what slotkeeper binds to by default, and what the Host check and launch mode accept."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """`localhost`, or an IPv4/IPv6 loopback address (brackets allowed)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
