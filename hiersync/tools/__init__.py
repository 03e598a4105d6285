"""The command-line tooling around hiersync: measurement, benchmarks and the emulated cluster.

Nothing here is imported by ``import hiersync``; ``python -m hiersync <command>`` imports
the one module its command needs (:mod:`hiersync.tools.cli`).

* :mod:`.calibrate` (with :mod:`.sweep`): measure alpha and beta per level, write a profile;
* :mod:`.collbench` (with :mod:`.linkrate`): an nccl-tests-like microbenchmark per level;
* :mod:`.bench` (with :mod:`.bench_spec`, :mod:`.bench_worker`, :mod:`.report`): schedules
  x bucket sizes side by side;
* :mod:`.testbed` (with :mod:`.netns`) and :mod:`.cluster`: an emulated multi-node
  cluster on one machine, and running a function on every rank of it.

Every table they print is laid out by :func:`hiersync._table.render` (the cost model's ``plan``
and ``project`` share it).
"""
