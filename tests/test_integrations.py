"""HF Accelerate and Lightning integrations, multi-process on gloo (2 nodes x 2 ranks, emulated).

One launch per framework runs every scenario in the same 4 processes (each framework import
costs seconds per rank): plain DDP vs period=1, period=4 invariants, checkpoint and resume.
"""

from __future__ import annotations

import os

import pytest
import torch

from hiersync.tools.launch import run

NODES = [0, 0, 1, 1]
STEPS = 10  # Accelerate: steps of the uninterrupted run; the checkpoint is taken after SAVE_AT
SAVE_AT = 5  # mid-period for period=4 (syncs after steps 3 and 7)


def _elastic_env() -> None:
    """Make the frameworks see a torchrun-launched job and use the existing process group."""
    rank = os.environ["RANK"]
    os.environ.update(
        LOCAL_RANK=rank,
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"],
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29999",  # never used: the process group is already initialized
    )


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


# ---------------------------------------------------------------------------- Accelerate
def _accel_run(
    period: int | None,
    start: int,
    stop: int,
    save_dir: str | None,
    load_dir: str | None,
    register: str = "rank_states",
) -> dict:
    """``register``: what goes to ``accelerator.register_for_checkpointing``: ``RankStates(state, model, opt)``
    ("rank_states") or the bare ``HierState`` ("state"), as a user who has not read the docs would."""
    import torch.distributed as dist
    from accelerate import Accelerator

    import hiersync
    from hiersync.integrations.accelerate import RankStates

    accelerator = Accelerator(cpu=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    state = None
    if period is not None:
        state = hiersync.register(model, opt, period=period)
        accelerator.register_for_checkpointing(RankStates(state, model, opt) if register == "rank_states" else state)
    if load_dir is not None:
        accelerator.load_state(load_dir)
    rank = dist.get_rank()
    per_step = []
    for step in range(start, stop):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        per_step.append(_flat(model))
        if save_dir is not None and step + 1 == SAVE_AT:
            accelerator.save_state(save_dir)
    stats = state.stats.as_dict() if state is not None else None
    step = state.step if state is not None else None
    if state is not None:
        state.close()
    return {"per_step": per_step, "stats": stats, "step": step}


def _accel_unsaveable(save_dir: str) -> str:
    """The bare ``HierState`` of a pure hook (no attached optimizer) registered for checkpointing:
    ``save_state`` must refuse it, naming the fix, on every rank."""
    from accelerate import Accelerator

    import hiersync

    accelerator = Accelerator(cpu=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    state = hiersync.register(model, None, period=4)
    accelerator.register_for_checkpointing(state)
    x, y = _batch(0, 0)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    try:
        accelerator.save_state(save_dir)
    except (TypeError, ValueError) as e:
        return str(e)
    finally:
        state.close()
    return "saved"


def _accelerate_scenarios(root: str) -> dict:
    _elastic_env()
    ckpt, natural = os.path.join(root, "state"), os.path.join(root, "natural")
    return {
        "ddp": _accel_run(None, 0, STEPS, None, None),
        "p1": _accel_run(1, 0, STEPS, None, None),
        "p4": _accel_run(4, 0, STEPS, ckpt, None),
        "p4_resumed": _accel_run(4, SAVE_AT, STEPS, None, ckpt),
        "p4_natural": _accel_run(4, 0, SAVE_AT, natural, None, register="state"),
        "p4_natural_resumed": _accel_run(4, SAVE_AT, STEPS, None, natural, register="state"),
        "unsaveable": _accel_unsaveable(os.path.join(root, "unsaveable")),
    }


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory):
    pytest.importorskip("accelerate")
    root = str(tmp_path_factory.mktemp("accel"))
    return run(_accelerate_scenarios, 4, (root,), node_ids=NODES, timeout=120)


def test_accelerate_period1_equals_ddp(accelerate_results):
    for r in accelerate_results:
        for a, b in zip(r["ddp"]["per_step"], r["p1"]["per_step"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_accelerate_period4_invariants(accelerate_results):
    steps = [r["p4"]["per_step"] for r in accelerate_results]
    for i in range(STEPS):
        assert torch.equal(steps[0][i], steps[1][i]) and torch.equal(steps[2][i], steps[3][i]), i
        if i % 4 == 3:  # a sync step, attached optimizer: every rank identical after it
            assert all(torch.equal(steps[0][i], s[i]) for s in steps), i
    assert not torch.equal(steps[0][4], steps[2][4])  # between syncs the nodes differ
    stats = accelerate_results[0]["p4"]["stats"]
    assert stats["sync_steps"] == STEPS // 4 and stats["bytes_sent"]["inter"] > 0


def test_accelerate_save_load_state_resumes_exactly(accelerate_results):
    for r in accelerate_results:
        resumed = r["p4_resumed"]["per_step"]
        uninterrupted = r["p4"]["per_step"][SAVE_AT:]
        assert len(resumed) == len(uninterrupted) == STEPS - SAVE_AT
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)


def test_accelerate_bare_state_registered_for_checkpointing_resumes_exactly(accelerate_results):
    # accelerator.register_for_checkpointing(state): Accelerate writes registered objects from rank 0
    # only, yet every rank resumes its own model, optimizer and hiersync state
    for r in accelerate_results:
        resumed = r["p4_natural_resumed"]["per_step"]
        uninterrupted = r["p4"]["per_step"][SAVE_AT:]
        assert len(resumed) == len(uninterrupted) == STEPS - SAVE_AT
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)
        assert r["p4_natural_resumed"]["step"] == STEPS
        assert r["p4_natural_resumed"]["stats"]["sync_steps"] == r["p4"]["stats"]["sync_steps"] == STEPS // 4


def test_accelerate_refuses_at_save_what_it_could_not_resume(accelerate_results):
    # a state that knows no optimizer cannot bring the others' optimizer states along: save_state
    # fails on every rank, before the training it protects is spent, and names the fix
    for r in accelerate_results:
        assert "RankStates(state, model, optimizer)" in r["unsaveable"], r["unsaveable"]


# ---------------------------------------------------------------------------- Lightning
BATCHES = 6  # per rank per epoch: a checkpoint at the end of epoch 0 is mid-period for period=4
EPOCHS = 2


def _lightning_scenarios(root: str) -> dict:
    _elastic_env()
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from hiersync.integrations.lightning import HierSyncCallback

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BATCHES * 2, 8, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())

    class Module(pl.LightningModule):
        def __init__(self, by_step: bool = False) -> None:
            super().__init__()
            self.net = _net()
            self.by_step = by_step  # this rank's batch of the global step, whatever the loader yields
            self.after_batch: list[torch.Tensor] = []
            self.at_train_end: torch.Tensor | None = None
            self.at_validation: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            xb, yb = _batch(self.global_rank, self.global_step) if self.by_step else batch
            return torch.nn.functional.mse_loss(self.net(xb), yb)

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(xb), yb))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after_batch.append(_flat(self.net))

        def on_validation_start(self):  # runs after HierSyncCallback.on_validation_start
            self.at_validation.append(_flat(self.net))

        def on_train_end(self):
            self.at_train_end = _flat(self.net)  # after HierSyncCallback.on_train_end (callbacks run first)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(callbacks: list, ckpt_path: str | None = None, val: bool = False, by_step: bool = False, **kw) -> Module:
        module = Module(by_step)
        kw.setdefault("max_epochs", EPOCHS)
        trainer = pl.Trainer(
            strategy=DDPStrategy(cluster_environment=TorchElasticEnvironment()),
            accelerator="cpu",
            devices=dist.get_world_size(),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            num_sanity_val_steps=0,
            default_root_dir=root,
            **kw,
        )
        loader = DataLoader(data, batch_size=2, shuffle=False)
        trainer.fit(module, loader, DataLoader(data, batch_size=8) if val else None, ckpt_path=ckpt_path)
        module.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}  # type: ignore[assignment]
        module.trainer_ = trainer  # type: ignore[assignment]
        return module

    out: dict = {}
    m = fit([])
    out["ddp"] = m.after_batch
    m = fit([HierSyncCallback(period=1)])
    out["p1"] = m.after_batch
    cb = HierSyncCallback(period=4)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1, every_n_epochs=1)
    m = fit([cb, ckpt])
    out["p4"] = {"after_batch": m.after_batch, "train_end": m.at_train_end, "final": _flat(m.net)}
    out["p4_metrics"] = m.metrics
    out["p4_stats"] = cb.state.stats.as_dict()
    first = os.path.join(root, "ckpt", f"epoch=0-step={BATCHES}.ckpt")
    m = fit([HierSyncCallback(period=4)], ckpt_path=first)
    out["p4_resumed"] = {"after_batch": m.after_batch, "train_end": m.at_train_end}
    m = fit([HierSyncCallback(period=4)], val=True, check_val_every_n_epoch=1, limit_val_batches=1)
    out["val_synced"] = m.after_batch[BATCHES - 1]  # the params validation of epoch 0 synchronized from
    out["val_seen"] = m.at_validation
    # trainer.save_checkpoint after fit() returned (mid-period), then a longer fit from it. Batches by
    # global step: resumed from such a checkpoint, Lightning replays the first batch of the finished epoch
    # as one more epoch before the next (lightning 2.6), so the loader's batches would not line up.
    steps = dict(by_step=True, max_epochs=-1)
    cb = HierSyncCallback(period=4)
    out["by_step"] = {
        "after_batch": fit([cb], max_steps=2 * BATCHES, **steps).after_batch,
        "stats": cb.state.stats.as_dict(),
    }
    for name, keep in (("after_fit", {"sync_at_fit_end": False}), ("after_fit_synced", {})):
        path = os.path.join(root, f"{name}.ckpt")
        m = fit([HierSyncCallback(period=4, **keep)], max_steps=BATCHES, **steps)
        m.trainer_.save_checkpoint(path)
        cb = HierSyncCallback(period=4, **keep)
        m = fit([cb], ckpt_path=path, max_steps=2 * BATCHES, **steps)
        out[name] = {"after_batch": m.after_batch, "step": cb.state.step, "stats": cb.state.stats.as_dict()}
    return out


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory):
    pytest.importorskip("lightning")
    return run(_lightning_scenarios, 4, (str(tmp_path_factory.mktemp("lightning")),), node_ids=NODES, timeout=180)


@pytest.mark.slow
def test_lightning_period1_equals_ddp(lightning_results):
    for r in lightning_results:
        assert len(r["ddp"]) == len(r["p1"]) == BATCHES * EPOCHS
        for a, b in zip(r["ddp"], r["p1"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lightning_period4_invariants_and_fit_end_sync(lightning_results):
    steps = [r["p4"]["after_batch"] for r in lightning_results]
    for i in range(BATCHES * EPOCHS):
        assert torch.equal(steps[0][i], steps[1][i]) and torch.equal(steps[2][i], steps[3][i]), i
        if i % 4 == 3:
            assert all(torch.equal(steps[0][i], s[i]) for s in steps), i
    assert not torch.equal(steps[0][4], steps[2][4])
    finals = [r["p4"]["final"] for r in lightning_results]
    assert all(torch.equal(finals[0], f) for f in finals)  # synchronized at the end of fit
    stats = lightning_results[0]["p4_stats"]
    assert stats["sync_steps"] == BATCHES * EPOCHS // 4
    metrics = lightning_results[0]["p4_metrics"]
    assert metrics["hiersync/sync_steps"] == stats["sync_steps"]
    assert metrics["hiersync/inter_bytes"] > 0


@pytest.mark.slow
def test_lightning_checkpoint_resume_exact(lightning_results):
    for r in lightning_results:
        resumed = r["p4_resumed"]["after_batch"]
        uninterrupted = r["p4"]["after_batch"][BATCHES:]
        assert len(resumed) == len(uninterrupted) == BATCHES * (EPOCHS - 1)
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(r["p4"]["train_end"], r["p4_resumed"]["train_end"])


@pytest.mark.slow
def test_lightning_checkpoint_saved_after_fit_continues_the_schedule(lightning_results):
    reference = lightning_results[0]["by_step"]["stats"]
    assert reference["sync_steps"] == 2 * BATCHES // 4
    for r in lightning_results:
        # kept per rank (no synchronize at the end of the first fit): bitwise the uninterrupted run
        resumed = r["after_fit"]["after_batch"]
        uninterrupted = r["by_step"]["after_batch"][BATCHES:]
        assert len(resumed) == len(uninterrupted) == BATCHES
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)
        # synchronized at the end of the first fit (the default): the schedule goes on from step BATCHES
        for name in ("after_fit", "after_fit_synced"):
            assert r[name]["step"] == 2 * BATCHES, name
            for k in ("steps", "sync_steps", "local_steps", "exact_steps"):
                assert r[name]["stats"][k] == reference[k], (name, k)


@pytest.mark.slow
def test_lightning_synchronizes_before_validation(lightning_results):
    # epoch 0 ends mid-period (6 steps): the nodes differ, and validation sees one world-mean model
    assert not torch.equal(lightning_results[0]["val_synced"], lightning_results[2]["val_synced"])
    seen = [r["val_seen"] for r in lightning_results]
    assert len(seen[0]) == EPOCHS
    assert all(torch.equal(seen[0][0], s[0]) for s in seen)
