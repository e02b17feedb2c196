"""spikewatch observatory: metric store, spike detection and the rollback policy."""
