"""Byte-level GPT on the Python standard library, plain PyTorch DDP + hiersync, under torchrun.

    python -m hiersync testbed --nodes 2 --procs-per-node 2 -- examples/lm_torchrun.py --steps 20
    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        examples/lm_torchrun.py --period 4 --fragments 4 --overlap 1
"""

import time

import _lm
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync

args = _lm.parser(__doc__).parse_args()
rank, world, device = _lm.setup()
train, val = _lm.load_text(args.text_mb)
model = _lm.GPT(args).to(device)
ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
state = hiersync.register(ddp, opt, **_lm.hiersync_options(args))
say = print if rank == 0 else lambda *a, **k: None
say(f"{sum(p.numel() for p in model.parameters()):,} parameters, {world} ranks, {device.type}")
say(f"initial val loss {_lm.evaluate(model, val, args, device):.4f}")

start = time.perf_counter()
for step in range(args.steps):
    x, y = _lm.train_batch(train, args, rank, step, device)
    _, loss = ddp(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    if step % 50 == 0 or step == args.steps - 1:
        say(f"step {step} train loss {loss.item():.4f} ({time.perf_counter() - start:.1f} s)")

state.synchronize(ddp)  # every rank now holds the same (world-mean) weights
say(f"inter-node bytes sent by rank 0: {state.stats.as_dict()['bytes_sent']['inter']:,}")
say(f"final val loss {_lm.evaluate(model, val, args, device):.4f}")
state.close()
dist.destroy_process_group()
