"""Stage 2, load: how it is sent. Arrival profiles, sessions, the streaming HTTP client, the open-loop
load generator and its workers, retries, progress, and launching a server to drive. Imports trace.
"""
