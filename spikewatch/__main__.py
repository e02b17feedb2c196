"""`python -m spikewatch ...` is the `spikewatch` command (for torchrun: `torchrun ... -m spikewatch
train CONFIG`)."""

from spikewatch.trainer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
