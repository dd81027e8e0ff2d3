"""Secrets out of what is shown or written: command lines in logs and records, config dumps.

    redact_args(["opid-train", "analyzer.api_key=sk-123", "--api-key", "abc"])
        -> ["opid-train", "analyzer.api_key=***", "--api-key", "***"]

A secret is the value of a config override whose last dotted part names a key (`api_key`, `*_api_key`, `token`,
`password`, `secret`), or the argument after / value of a command-line flag with such a name (`--api-key X`,
`--api-key=X`, SGLang's and the router's spelling), also inside one string that holds a command line, and the value
of a mapping key with such a name (`redact_tree`: a server's /server_info reply). Standalone (no imports of the package), so every layer may use it.
"""
from __future__ import annotations

import re
from typing import Iterable

MASK = "***"
_SECRET_NAME = r"(?:[A-Za-z0-9]+[_-])*(?:api[_-]?key|token|password|secret)"
_OVERRIDE = re.compile(r"^((?:[A-Za-z0-9_]+\.)*" + _SECRET_NAME + r"=)(.*)$", re.I | re.S)
_FLAG = re.compile(r"^(--?" + _SECRET_NAME + r")(=.*)?$", re.I | re.S)
_KEY = re.compile(_SECRET_NAME, re.I)
_FLAG_IN_TEXT = re.compile(r"((?<![A-Za-z0-9_-])--?" + _SECRET_NAME + r")(=|\s+)(?!-)(\S+)", re.I)


def redact_args(args: Iterable) -> list[str]:
    """`args` (str() of each) with every secret value replaced by ***."""
    out: list[str] = []
    mask_next = False
    for a in (str(x) for x in args):
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        m = _OVERRIDE.match(a)
        if m and m.group(2):
            out.append(m.group(1) + MASK)
            continue
        m = _FLAG.match(a)
        if m:
            if m.group(2) is None:
                mask_next = True
                out.append(a)
            else:
                out.append(m.group(1) + "=" + MASK)
            continue
        out.append(a)
    return out


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each secret (6 characters or more; "EMPTY" is no secret) replaced by ***."""
    for s in secrets:
        if s and s != "EMPTY" and len(s) >= 6:
            text = text.replace(s, MASK)
    return text


def redact_tree(obj, secrets: Iterable[str] = ()):
    """A copy of a JSON-like value (dicts, lists, strings) with every secret masked: the value of a key that names a
    secret (`api_key`, `admin_api_key`, ...), secret flags and overrides in a list of strings (redact_args) and in a
    string holding a command line (`... --api-key abc ...`), and any occurrence of one of `secrets` (redact_text)."""
    secrets = [s for s in secrets if s]
    if isinstance(obj, dict):
        return {k: (MASK if obj[k] and isinstance(k, str) and _KEY.fullmatch(k) else redact_tree(obj[k], secrets))
                for k in obj}
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(x, str) for x in obj):
            obj = redact_args(obj)
        return [redact_tree(x, secrets) for x in obj]
    if isinstance(obj, str):
        return redact_text(_FLAG_IN_TEXT.sub(lambda m: m.group(1) + m.group(2) + MASK, obj), secrets)
    return obj
