"""The syntax of the URLs slotkeeper is given: replicas' base URLs and the allow-list's patterns."""

from __future__ import annotations

import re

# An absolute http(s) base URL: a scheme, a host (a name, an IPv4 address or a bracketed IPv6 one) and a port; no
# user, path, query or fragment. `*` is allowed only in allow-list patterns.
_BASE_URL = re.compile(r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_PATTERN = re.compile(r"https?://(?:[A-Za-z0-9*](?:[A-Za-z0-9.*-]*[A-Za-z0-9*])?|\[[0-9A-Fa-f:.*]+\])(?::[0-9*]{1,5})?")


def is_base_url(text: str) -> bool:
    return _BASE_URL.fullmatch(text) is not None


def is_url_pattern(text: str) -> bool:
    return _PATTERN.fullmatch(text) is not None
