"""Speculative decoding, the worker side: proposers (n-gram lookup, a draft model) and verification.

Drafts are just more tokens of a step (vLLM V1): the scheduler schedules a decode's 1 + K tokens, the
runner computes logits at each, verification keeps the accepted prefix plus one token of the target,
and a proposer drafts the next step's tokens from the request's confirmed tokens.
"""
