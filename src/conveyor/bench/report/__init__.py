"""Stage 5, report: what a person reads. The console dashboard, number formats, the HTML report and its
plots. Imports the stages before it.
"""
