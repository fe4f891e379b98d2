"""On top, cli: the `conveyor trace | bench | report | plan` subcommands. Parses flags into the stages'
configs; may import every stage.
"""
