"""`python -m ckpt_cli` (also what torchrun launches)."""

from .cli import main

if __name__ == "__main__":
    main()
