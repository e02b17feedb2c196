"""A training loop in the shape of nanoGPT's train.py (karpathy/nanoGPT at 3adf61e), written
here for spikewatch's tests and docs: module-level settings overridden by --key=value, a
random-window get_batch on torch's global RNG, the loop's own iter_num driving a warmup-cosine
learning rate, an evaluation and ckpt.pt every eval_interval, gradient accumulation with the
next batch fetched inside the micro-step loop, a GradScaler, unscale_, clip, scaler.step,
update, zero_grad. train.py is the loop without spikewatch; train_spikewatch.py is the same loop
with it, the lines marked `# spikewatch` all that changes (`diff` the two): the loop keeps its
shape, the Watch gates the update inside `optimizer.step()` (`route`), measures the gradient
before the loop's own clip, and the loop's iter_num follows the Watch's step (a rollback moves
it back; after a kill the same command resumes).

    python examples/nanogpt/train_spikewatch.py --max_iters=300 --out_dir=out

--poison_at=K --poison_len=N: the training batches of iterations K to K + N - 1, counted by the
stream (which goes on after a rollback), come from a corrupt stretch of it (random bytes).
--kill_at=K: the process dies at iteration K (for the tests: a crash, then the same command).
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
from model import GPT

from spikewatch import Watch  # spikewatch
from spikewatch.corpus import text_corpus

out_dir = "out"
eval_interval = 100
eval_iters = 10
log_interval = 50
always_save_checkpoint = True
gradient_accumulation_steps = 2
batch_size = 8
block_size = 64
n_layer = 2
n_head = 4
n_embd = 128
learning_rate = 2e-3
max_iters = 300
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 20
lr_decay_iters = 300
min_lr = 2e-4
device = "cpu"
dtype = "float32"
compile = False
ddp = False
seed = 1337
poison_at = -1
poison_len = 10
kill_at = -1
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short: --key=value
    key, val = arg[2:].split("=", 1)
    old = globals()[key]
    globals()[key] = (val == "True") if isinstance(old, bool) else type(old)(val)

os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device == "cpu" else torch.autocast(device, dtype=ptdtype)
train_data, val_data = text_corpus()
corrupt = torch.Generator().manual_seed(7)
draws = 0  # train batches drawn: the stream's position


def get_batch(split):
    global draws
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix]).long()
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix]).long()
    if split == "train":
        first = poison_at * gradient_accumulation_steps
        if 0 <= first <= draws < first + poison_len * gradient_accumulation_steps:
            y = torch.randint(0, 256, y.shape, generator=corrupt)  # a corrupt stretch
        draws += 1
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model = GPT(n_layer, n_head, n_embd, block_size).to(device)
scaler = torch.amp.GradScaler(device, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if compile:
    model = torch.compile(model)


@torch.no_grad()
def estimate_loss():  # (the validation split only: the training stream is the loop's)
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        X, Y = get_batch("val")
        with ctx:
            logits, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@torch.no_grad()
def fixed_val_loss():  # the same 32 windows for every run, whatever the RNG did
    g = torch.Generator().manual_seed(0)
    ix = torch.randint(len(val_data) - block_size - 1, (32,), generator=g)
    x = torch.stack([val_data[i : i + block_size] for i in ix]).long().to(device)
    y = torch.stack([val_data[i + 1 : i + 1 + block_size] for i in ix]).long().to(device)
    model.eval()
    loss = model(x, y)[1].item()
    model.train()
    return loss


watch = Watch(model, optimizer, max_steps=max_iters + 1,  # spikewatch
              run_dir=os.path.join(out_dir, "spikewatch"), resume="auto")  # spikewatch  # fmt: skip
watch.route(optimizer)  # spikewatch: optimizer.step() goes through the gate
iter_num = watch.step_count  # spikewatch: the Watch's checkpoint, after a kill
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        val_loss = estimate_loss()
        print(f"step {iter_num}: val loss {val_loss:.4f}")
        if val_loss < best_val_loss or always_save_checkpoint:
            best_val_loss = val_loss
            if iter_num > 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                }
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    if iter_num == kill_at:
        os._exit(1)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            watch.observe_loss(loss, share=True, tokens=X)  # spikewatch
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num = watch.step_count  # spikewatch: moved back by a rollback
    if iter_num > max_iters:
        break

watch.close()  # spikewatch
print(json.dumps({"iter_num": iter_num, "fixed_val_loss": fixed_val_loss(), "draws": draws}))
