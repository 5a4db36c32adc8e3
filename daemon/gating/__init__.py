"""The gate as a pipeline of named steps: what happens to a made candidate before it serves.

    skipped -> gate kind -> drift bound -> held-out check -> canary hand-off -> publish -> rejected

Each step (``daemon/gating/steps.py``) reads the ``GateRun`` (the candidate, its scenario and head, the metrics
so far) and either ends the run with a ``StepOutcome`` (published, held, written down) or lets the next step
have it (None). A new check is one more step in ``STEPS``. What the steps use of the learning loop (the chains,
the events, the engine, where the lineage goes next) is the ``Host`` protocol, which ``daemon.learning.Learner``
implements, so each step runs alone against a stand-in host in its tests.
"""

from __future__ import annotations

from daemon.gating.outcome import GateRun, Host, Step, StepOutcome
from daemon.gating.steps import STEPS, run

__all__ = ["STEPS", "GateRun", "Host", "Step", "StepOutcome", "run"]
