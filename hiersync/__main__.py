from hiersync.tools.cli import main

raise SystemExit(main())
