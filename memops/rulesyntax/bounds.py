"""The bounds of a replication rule, and the error that refuses one outside them.

The MemoryPolicy's schema (:mod:`memops.specs.memorypolicy`) writes them into the CRD; the
scheduler checks what it is sent against them again (:func:`memops.scheduler.rules.parse`).
"""

from __future__ import annotations

MAX_RULES = 32
"""Key rules and pod rules, each: rules are matched per key prefix, so this bounds that cost."""
MAX_PATTERN_CHARS = 256
"""The longest prefix or glob."""
MAX_REPLICAS = 16
PATTERN_REFUSED = (
    'regular expressions are no longer accepted, their match time has no bound; write a glob instead (glob: "train-*")'
)


class RuleError(ValueError):
    """A rule that is refused; the message names the field."""
