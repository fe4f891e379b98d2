"""Stage 1, trace: what is sent. The trace format, its generators (chat, long context, agent/RAG),
import from logs and datasets, anonymization, token counting. Imports no other stage.
"""
