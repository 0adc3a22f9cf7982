"""echorl: reinforcement-learning post-training of language models on decoupled hardware.

The package follows the Echo design (arXiv 2508.05387): samplers and trainers on
separate machines joined by a broker. This release holds the foundation: the tiny
model, the tasks, the GRPO family of losses and the co-located reference loop.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
