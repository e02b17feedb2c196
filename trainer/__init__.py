"""spikewatch trainer: a GPT with stability switches, probes and checkpoints."""
