"""``te-dist train``: the model, its data (synthetic, or a token or text file), training loop,
checkpoints and plots behind the command.

    cli (parent) --validates config and data--> torchrun --starts--> worker (every rank) --> loop.train
                                                    model / datasets / parallel / checkpoint / plots
"""

from .config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
