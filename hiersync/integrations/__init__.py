"""Glue for training frameworks. Nothing here is imported by ``import hiersync``.

* :mod:`hiersync.integrations.accelerate`: :class:`~hiersync.integrations.accelerate.RankStates`,
  every rank's state in Accelerate's rank-0 ``save_state``, so that ``load_state`` resumes
  hiersync exactly (also what a ``HierState`` given to ``register_for_checkpointing`` saves).
* :mod:`hiersync.integrations.lightning`: :class:`~hiersync.integrations.lightning.HierSyncCallback`
  (needs ``pip install hiersync[lightning]``).
* :mod:`hiersync.integrations.transformers`: the HF Trainer's
  :class:`~hiersync.integrations.transformers.HierSyncCallback` (needs ``pip install hiersync[transformers]``).

See docs/integrations.md.
"""
