"""Conveyor: a continuous-batching LLM serving engine, with the benchmark and planner that prove it.

Importing `conveyor` loads nothing heavy: the engine (torch) is imported only by the subcommands and
modules that need it, so `conveyor.bench` and `conveyor.core` work without torch installed.
"""

__version__ = "0.1.0"
