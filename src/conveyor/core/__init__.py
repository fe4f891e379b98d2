"""The scheduler core: pure Python over ints (no torch), testable on a CPU in milliseconds."""
