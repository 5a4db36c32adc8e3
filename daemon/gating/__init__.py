"""The gate as a pipeline of named steps: what happens to a made candidate before it serves.

    skipped -> gate kind -> drift bound -> held-out check -> canary hand-off -> publish -> rejected

Each step (``daemon/gating/steps.py``) reads the ``GateRun`` (the candidate, its scenario and head, the metrics
so far) and either ends the run with a ``StepOutcome`` (published, held, written down) or lets the next step
have it (None). A new check is one more step in ``STEPS``. What the steps use of the learning loop (the chains,
the events, the engine, where the lineage goes next) is the ``Host`` protocol, which ``daemon.learning.Learner``
implements, so each step runs alone against a stand-in host in its tests.

Nothing is imported here: ``recipes.base`` reads the held-out check's settings (``daemon.gating.heldout``) and
must not pull the steps (and the chains they name) in with them. Import ``daemon.gating.steps`` (``run``,
``STEPS``) and ``daemon.gating.outcome`` (``GateRun``, ``StepOutcome``, ``Host``).
"""
