"""ckpt: the command-line tool for sharded and resumable training checkpoints."""

__version__ = "0.1.0"
