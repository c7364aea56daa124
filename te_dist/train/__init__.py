"""``te-dist train``: the model, synthetic data, training loop and checkpoints behind the command.

    cli (parent) --validates config--> torchrun --starts--> worker (every rank) --> loop.train
                                                                  model / data / parallel / checkpoint
"""

from .config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
