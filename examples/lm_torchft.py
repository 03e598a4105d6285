"""Byte-level GPT on the Python standard library, DDP or FSDP2 + hiersync on torchft: training goes on when a node dies.

Each node is its own torchrun job (a torchft replica group); a Lighthouse forms the quorum.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &          # once, on a stable host
    TORCHFT_LIGHTHOUSE=http://$HEAD:29510 REPLICA_GROUP_ID=$NODE \\
        torchrun --standalone --nproc-per-node 8 examples/lm_torchft.py --period 4 --fragments 4 --overlap 1
    python -m hiersync ft-testbed --nodes 3 --kill 2@60 --restart-after 5 -- examples/lm_torchft.py --steps 300
    python -m hiersync ft-testbed --nodes 2 --procs-per-node 2 --kill 1@60 --restart-after 5 -- \
        examples/lm_torchft.py --fsdp --period 4 --fragments 2 --overlap 1 --compress int4 --steps 300

With ``--fsdp`` each rank's model and optimizer state are its own shards (DTensors); torchft
sends them to the joiner's rank that holds the same shards.

Local rank 0 of each node prints ``hiersync-ft node N step S loss L time T`` after every
step (what the testbed reads). A node that joins resumes at its peers' step (``state.step``).
"""

import datetime
import os
import sys
import time

import _lm
import torch
import torch.distributed as dist
import torchft
from torch.nn.parallel import DistributedDataParallel as DDP

import hiersync

p = _lm.parser(__doc__)
p.add_argument("--replica-id", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", 0)), help="this node's number")
p.add_argument("--timeout", type=float, default=30.0, help="s a rail collective or a commit may take (frozen peers)")
p.add_argument("--quorum-timeout", type=float, default=300.0, help="s a quorum may wait (covers a node's restart)")
p.add_argument("--step-sleep", type=float, default=0.0, help="s of extra 'compute' per step (slows a demo down)")
p.add_argument(
    "--start-nodes",
    type=int,
    default=int(os.environ.get("HIERSYNC_FT_START_NODES", 1)),
    help="a starting job waits for this many nodes in its first quorum",
)
p.add_argument("--fsdp", action="store_true", help="shard the model inside the node with FSDP2 (hiersync.node_mesh)")
args = p.parse_args()
rank, world, device = _lm.setup()
node = args.replica_id
train, val = _lm.load_text(args.text_mb)
model = _lm.GPT(args).to(device)
if args.fsdp:  # each block one FSDP unit, the rest in the root's; the rail averages each rank's own shards
    from torch.distributed.fsdp import fully_shard

    mesh = hiersync.node_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    ddp = fully_shard(model, mesh=mesh)
else:
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lm.lr_at(s, args))


def load_state(sd: dict) -> None:  # what a joiner receives from a live peer
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
    sched.load_state_dict(sd["sched"])


timeout = datetime.timedelta(seconds=args.timeout)
pg = torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(timeout=timeout)
manager = torchft.Manager(
    pg=pg,
    min_replica_size=1,
    use_async_quorum=False,
    load_state_dict=load_state,
    state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
    replica_id=f"node{node}",
    timeout=timeout,
    quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout),
)
state = hiersync.register(ddp, opt, manager=manager, start_nodes=args.start_nodes, **_lm.hiersync_options(args))
say = print if rank == 0 else lambda *a, **k: None
n_params = sum(p.numel() for p in model.parameters())
say(f"node {node}: {n_params:,} parameters, {world} ranks, joined at step {state.step}")

while state.step < args.steps:
    step = state.step
    x, y = _lm.train_batch(train, args, node * world + rank, step, device)  # each node its own data
    _, loss = ddp(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    time.sleep(args.step_sleep)
    say(f"hiersync-ft node {node} step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)

state.synchronize(ddp)  # the quorum's mean weights
stats = state.stats.as_dict()
say(f"node {node}: failed syncs {stats['failed_syncs']}, heals {stats['heals']}, nodes {stats['sync_participants']}")
say(f"final val loss {_lm.evaluate(model, val, args, device):.4f}", flush=True)
manager.shutdown(wait=False)
dist.barrier()
sys.stdout.flush()
os._exit(0)  # torch 2.13 + gloo can abort at interpreter exit (docs/design.md)
