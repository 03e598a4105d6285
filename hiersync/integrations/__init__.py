"""Glue for training frameworks. ``import hiersync`` imports none of them; its public names
load :mod:`~hiersync.integrations.accelerate` (which does not import Accelerate) for the
checkpoint adapter it registers with the core.

* :mod:`hiersync.integrations.accelerate`: :class:`~hiersync.integrations.accelerate.RankStates`,
  every rank's state in Accelerate's rank-0 ``save_state``, so that ``load_state`` resumes
  hiersync exactly (also what a ``HierState`` given to ``register_for_checkpointing`` saves).
* :mod:`hiersync.integrations.lightning`: :class:`~hiersync.integrations.lightning.HierSyncCallback`
  (needs ``pip install hiersync[lightning]``).
* :mod:`hiersync.integrations.transformers`: the HF Trainer's
  :class:`~hiersync.integrations.transformers.HierSyncCallback` (needs ``pip install hiersync[transformers]``).

See docs/integrations.md.
"""
