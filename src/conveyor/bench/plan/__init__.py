"""Beside decide, plan: what fits. The GPU memory plan (weights + KV cache + overhead) and the GPU
catalog. Imports nothing from the other stages.
"""
