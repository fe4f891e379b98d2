"""Stage 3, measure: what happened. Client and server metrics, Prometheus text, the steady-state window,
validity, intervals, the fixed things, and one run end to end (runner) written as a run directory.
Imports trace and load.
"""
