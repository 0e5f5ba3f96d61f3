"""rollfleet: the rollout-serving layer for LLM reinforcement learning.

A fleet of inference replicas (vLLM, SGLang, or a simulated engine) on Ray, routed with sticky,
load-aware policies, surviving weight updates mid-rollout through abort-and-resume.
"""

__version__ = "0.1.0"
