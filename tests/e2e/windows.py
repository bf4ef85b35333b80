"""How long an end-to-end test watches for something that must not happen (:func:`tests.polling.stays`).

A negative asserted at one moment passes when the wrong change comes a pass later. Each window
here holds one whole pass of the operator's that began after the window opened (read from its
code: the longest gap between two passes, then the pass itself), so that a wrong decision made on
the state the test set up fails the test. One pass, not more: every window is the suite's time.
"""

from __future__ import annotations

from memops.controllers import policy, retirement

PASS_ITSELF = 4.0
"""What a pass takes on a loaded two-core machine, at most: its reads and writes."""

POLICY_PASS = policy._STEADY_SECONDS + PASS_ITSELF
"""A pass of a MemoryPolicy: one starts at most ``_STEADY_SECONDS`` after the last (a plain policy
at rest; every ``_IDLE_SECONDS`` otherwise)."""

DISRUPTION_DECISION = policy._DISRUPTION_SECONDS + policy._STEADY_SECONDS + PASS_ITSELF
"""A decision of the disruption annotations: on the first pass at least ``_DISRUPTION_SECONDS``
after the last decision, and passes are up to ``_STEADY_SECONDS`` apart."""

HOOK_READ = policy._HOOK_EVENTS_SECONDS + policy._STEADY_SECONDS + PASS_ITSELF
"""A read of the namespace's FailedPreStopHook events into a policy's status (``safetyNet``)."""

REQUEST_STEPS = 10 * retirement._RETRY_SECONDS
"""Ten steps of a RetirementRequest's daemon: a drain of an idle worker and its pod's removal take
a few of them."""
