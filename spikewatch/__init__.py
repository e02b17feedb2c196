"""spikewatch in your own training: `Watch` for any PyTorch loop; `spikewatch.hf` and
`spikewatch.lightning` for Hugging Face's Trainer and PyTorch Lightning.

    from spikewatch import AdamW, Watch

    optimizer = AdamW(model.parameters(), lr=3e-4)  # torch's AdamW, refusable on the GPU
    watch = Watch(model, optimizer, scheduler, max_steps=1000, grad_clip=1.0)
    for x, y in watch.batches(get_batch):   # get_batch(index) -> a batch
        loss = model(x, y)
        loss.backward()
        watch.step(loss)                    # optimizer.step, scheduler.step, zero_grad inside
    watch.close()

This package is the public surface only; the machinery lives in `trainer/` (the Watch and its
probes, guard and checkpoints) and `observatory/` (detector, policy, store).
"""

from trainer.config import WatchSettings
from trainer.core.blocklist import without_blocked
from trainer.model.attention import max_logits
from trainer.model.attn_max import AttnMax
from trainer.model.optim.factor import AdamW
from trainer.watch import Watch

__all__ = ["AdamW", "AttnMax", "Watch", "WatchSettings", "max_logits", "without_blocked"]
