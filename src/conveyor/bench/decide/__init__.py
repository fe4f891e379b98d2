"""Stage 4, decide: what it means. The objective (SLO), rate sweeps, studies, point verdicts, the
recommendation, its checklist and the diagnosis. Imports the stages before it.
"""
