"""Readers of other tools' logs: runs spikewatch does not control, read as they were written.

- `tfevents`: TensorBoard's event files (the record framing and the scalars in them);
- `wandb_log`: a W&B run's offline `.wandb` log;
- `scan`: a finished log (TensorBoard, CSV, JSON lines) scanned once for spikes (`spikewatch scan`);
- `follow`: a log that is still being written, followed as it grows (`spikewatch follow`).
"""
