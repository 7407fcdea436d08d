"""How hard the stateful property tests (hypothesis rule machines) try.

The suite's runs are sized so that the unit suite stays fast; `TESTS_DEEP=1` multiplies every
machine's examples by 20 for a run of its own (the figures go in the notes), e.g.
`TESTS_DEEP=1 .venv/bin/python -m pytest --timeout 0 tests/unit/engine/l1 tests/unit/engine/tenants`
(minutes a machine: without `--timeout 0` the suite's 300 s per test ends them).
(No KVDEPOT_ prefix: sidecars started by tests inherit the environment and refuse unknown names.)
"""

from __future__ import annotations

import os

from hypothesis import settings

DEEP = 20 if os.environ.get("TESTS_DEEP") == "1" else 1


def machine_runs(examples: int, steps: int) -> settings:
    """`examples` runs of up to `steps` rules each (times 20 with TESTS_DEEP=1), no deadline."""
    return settings(max_examples=examples * DEEP, stateful_step_count=steps, deadline=None)
