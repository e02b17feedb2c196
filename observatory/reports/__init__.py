"""Reports made from stored runs and from corpora, beside training or after it.

- `logbook`: a run's dated Markdown logbook, one entry per thing that happened
  (`spikewatch logbook RUN`);
- `census`: how often each kind of trouble happened in a run, per 1k steps;
- `quarantine`: the samples a run's rollbacks named, as a JSON-lines blocklist
  (`spikewatch quarantine RUN`);
- `datacheck`: documents with long repeated n-gram runs in a corpus, before training, as the
  same blocklist (`spikewatch data-check PATH...`);
- `sweeps`: a pre-registered grid of runs and its report (`spikewatch sweep`, `sweep-report`).
"""
