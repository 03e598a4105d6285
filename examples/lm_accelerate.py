"""Byte-level GPT on the Python standard library, HF Accelerate + hiersync, under torchrun.

python -m hiersync testbed --nodes 2 --procs-per-node 2 -- examples/lm_accelerate.py --steps 20
torchrun --nnodes 16 --nproc-per-node 8 ... examples/lm_accelerate.py   # or: accelerate launch ...
"""

import _lm
import torch
from accelerate import Accelerator

import hiersync
from hiersync.integrations.accelerate import RankStates

p = _lm.parser(__doc__)
p.add_argument("--save", help="folder for accelerator.save_state at the end (per-rank hiersync state included)")
args = p.parse_args()
_lm.setup()  # the process group and this rank's CUDA device (Accelerate adopts both)
accelerator = Accelerator(cpu=not torch.cuda.is_available())
rank, device = accelerator.process_index, accelerator.device
train, val = _lm.load_text(args.text_mb)
model = _lm.GPT(args)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))
model, opt = accelerator.prepare(model, opt)  # model: DDP; opt: AcceleratedOptimizer
state = hiersync.register(model, opt, **_lm.hiersync_options(args))
accelerator.register_for_checkpointing(RankStates(state, model, opt))
net = accelerator.unwrap_model(model)
accelerator.print(f"{sum(p.numel() for p in net.parameters()):,} parameters, {accelerator.num_processes} ranks")
accelerator.print(f"initial val loss {_lm.evaluate(net, val, args, device):.4f}")

for step in range(args.steps):
    x, y = _lm.train_batch(train, args, rank, step, device)
    _, loss = model(x, y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    if step % 50 == 0 or step == args.steps - 1:
        accelerator.print(f"step {step} train loss {loss.item():.4f}")

if args.save:
    accelerator.save_state(args.save)  # resume: same set-up, then accelerator.load_state(args.save)
state.synchronize(model)  # every rank now holds the same (world-mean) weights
accelerator.print(f"final val loss {_lm.evaluate(net, val, args, device):.4f}")
state.close()
accelerator.end_training()
