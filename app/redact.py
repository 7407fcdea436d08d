"""Masking credentials in URLs: the one helper every answer, log line and error message uses.

Role: a URL setting may carry a secret in two places: its user part (`redis://user:PASSWORD@host`,
`https://TOKEN@host`) and its query (`?api_key=...`, `?token=...`, redis-py's `?password=...`,
a presigned `?X-Amz-Signature=...`). `redact_url` replaces the secret by `***`: the password of
the user part (the user name stays), or the whole user part when it has no password (it is then
a token), and the value of every query parameter whose name looks like a credential (`SECRET_PARAM`:
token, key, secret, pass, pwd, auth, sig, credential, session, in any case, anywhere in the
name). Everything else stays as written. `redact_text` does the same to every URL inside free
text (an error message, a log line); app/logs.py runs it over every log line.

Pure: stdlib only, no state; any layer may use it (like app/errors.py).

Primitives: redact_url(url) -> str; redact_text(text) -> str.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit

__all__ = ["MASK", "SECRET_PARAM", "redact_text", "redact_url"]

MASK = "***"
#: a query parameter whose name matches holds a credential
SECRET_PARAM = re.compile(r"token|key|secret|pass|pwd|auth|sig|credential|session", re.IGNORECASE)
#: a URL inside free text: scheme://, then up to whitespace or a quote
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{1,15}://[^\s'\"<>`]+")


def redact_url(url: str) -> str:
    """`url` with its credentials replaced by `***` (see the module docstring), every other character
    as written; a string that is not a URL comes back unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ in the host: not a URL we can read; hide what might be one
        return url if "@" not in url else MASK
    out = url
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        user, colon, _ = userinfo.partition(":")
        out = out.replace(userinfo + "@", (f"{user}:{MASK}" if colon else MASK) + "@", 1)
    if parts.query and SECRET_PARAM.search(parts.query):
        fields = []
        for field in parts.query.split("&"):
            name, eq, _ = field.partition("=")
            fields.append(f"{name}={MASK}" if eq and SECRET_PARAM.search(unquote_plus(name)) else field)
        out = out.replace("?" + parts.query, "?" + "&".join(fields), 1)
    return out


def redact_text(text: str) -> str:
    """`text` with every URL in it passed through redact_url (cheap when it holds none)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
