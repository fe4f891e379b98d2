"""The benchmark and the decision, one sub-package per stage: trace -> load -> measure -> decide -> report,
with plan beside decide and cli on top. A stage imports only the stages before it (tests/test_layering.py);
the root holds the few helpers every stage shares (table_file.py, units.py). `bench` talks HTTP only.
"""
