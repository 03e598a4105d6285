from hiersync.cli import main

raise SystemExit(main())
