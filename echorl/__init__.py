"""echorl: reinforcement-learning post-training of language models on decoupled hardware.

The package follows the Echo design (arXiv 2508.05387): an inference swarm of samplers
and a training swarm, on separate machines of any kind, joined only by a broker over
HTTP, under sequential pull (sync) or asynchronous push-pull (async). README.md is the
start; docs/ the guide, and docs/architecture.md the design.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
