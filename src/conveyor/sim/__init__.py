"""The simulator on real traces: core's scheduler fed and read through bench's trace and run-directory records."""
