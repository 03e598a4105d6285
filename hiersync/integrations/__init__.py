"""Glue for training frameworks. Nothing here is imported by ``import hiersync``.

* :mod:`hiersync.integrations.accelerate`: :class:`~hiersync.integrations.accelerate.RankStates`,
  what to give ``accelerator.register_for_checkpointing`` so that ``save_state``/``load_state``
  resume hiersync exactly.
* :mod:`hiersync.integrations.lightning`: :class:`~hiersync.integrations.lightning.HierSyncCallback`
  (needs ``pip install hiersync[lightning]``).

See docs/integrations.md.
"""
