"""URLs in messages: a location is named without the secret a user may have written into it.

Every stage names files and URLs in its errors and logs; they all go through :func:`redact`, so a key written as
``s3://KEY:SECRET@bucket`` never reaches a log. Trade-off: only the user part of a URL is read, so a secret passed
in a query string stays (storage options carry those instead).
"""

from __future__ import annotations

import re


def redact(url: str) -> str:
    """``url`` without a secret key in its user part (``s3://KEY:SECRET@bucket`` → ``s3://KEY:***@bucket``)."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://[^:/@]*):[^@/]*@", r"\1:***@", url)
